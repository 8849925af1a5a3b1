"""The serving engines, one package each, and the registry of the roles they serve.

``ROLES`` is the registry: one line per engine per role, the role's name, the engine's name and
the ``module:attr`` of the object that keeps the role's protocol (:mod:`eagle3_assets.engines.roles`),
resolved on first use, so importing the registry imports no engine. A stage asks ``engine_role``
for the role of the engine its config names, and its Dagster config takes ``engine_names(role)`` as
a typed choice, so a wrong name is refused by the config schema with the list of valid ones; the
stage requires the resources ``engine_resources(role)`` lists and hands them to the role.

Each engine package holds its server process, its version rule and its CPU support where it has
them, and its HTTP backend where the stage reaches it over HTTP (``sglang/``: ``server.py``,
``backend.py``, ``capture.py``, ``acceptance.py``, ``cpu/``; ``vllm/``: ``server.py``, ``openai_ids.py``,
``extractor.py``, ``connector.py``, ``acceptance.py``; ``openrouter/``: ``backend.py``), and its roles in
``roles.py``. What every engine shares sits beside them: ``process.py`` (a server's lifecycle),
``versions.py`` (which versions serve what, for which target), ``roles.py`` and ``http/`` (the wire the
HTTP backends share with the generation stage's HTTP engine).
"""

from __future__ import annotations

import importlib

ROLES: dict[tuple[str, str], str] = {
    ("generate", "local"): "eagle3_assets.engines.local.roles:GENERATE",  # the embedded model in this process
    ("generate", "sglang"): "eagle3_assets.engines.sglang.roles:GENERATE",  # /generate, exact ids
    ("generate", "openrouter"): "eagle3_assets.engines.openrouter.roles:GENERATE",  # chat completions, text
    ("generate", "vllm"): "eagle3_assets.engines.vllm.roles:GENERATE",  # OpenAI API + token ids (any such server)
    ("extract", "local"): "eagle3_assets.engines.local.roles:EXTRACT",  # transformers, in the step or a job
    ("extract", "sglang"): "eagle3_assets.engines.sglang.roles:EXTRACT",  # a torchrun tensor-parallel job
    ("extract", "vllm"): "eagle3_assets.engines.vllm.roles:EXTRACT",  # an extraction server
    ("serve", "sglang"): "eagle3_assets.engines.sglang.roles:SERVE",  # EAGLE-3 worker, per-request counters
    ("serve", "vllm"): "eagle3_assets.engines.vllm.roles:SERVE",  # speculative config, Prometheus counters
}


def engine_names(role: str) -> tuple[str, ...]:
    """The engines serving ``role``, in registry order (the config's typed choice)."""
    names = tuple(name for r, name in ROLES if r == role)
    if not names:
        raise ValueError(f"unknown role {role!r}; the registry has {sorted({r for r, _ in ROLES})}")
    return names


def engine_resources(role: str) -> tuple[str, ...]:
    """The Dagster resources the engines serving ``role`` read (each role object's ``resources``): the
    stage requires them all, so an engine's own resource reaches its role without the stage naming it."""
    return tuple(sorted({key for name in engine_names(role) for key in engine_role(role, name).resources}))


def engine_role(role: str, name: str):
    """The object serving ``role`` for engine ``name``; an engine without it is refused, naming those with it."""
    if (role, name) not in ROLES:
        raise ValueError(f"engine {name!r} does not serve the {role!r} role; the engines that do: "
                         f"{list(engine_names(role))}")
    module, _, attr = ROLES[role, name].partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
