"""The drafter's kinds (its attention architecture: Llama-style, MLA), listed once.

A kind is one module or package that builds a :class:`DrafterKind`: its attention class, the
sizes it copies from the target (if any), the recipe layouts it refuses whatever the engine, and
what a target needs of it. Its exports are its serving formats, one per engine (``drafter/formats``,
``FORMATS``). Everything that varies with the kind asks this registry (``get_kind``) and never
names one, so a new kind is its own module plus one line in ``KINDS`` (and its formats).

The entries are ``"module:name"`` strings resolved on first use: the model
(``drafter/model.py``) consults the registry while the kinds' modules import the model, so the
registry itself imports none of them and the import graph stays acyclic.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# kind name -> "module:attribute" of its DrafterKind
KINDS = {
    "llama": "eagle3_assets.drafter.kinds.llama:KIND",  # GQA, the default: what every engine serves
    "mla": "eagle3_assets.drafter.kinds.mla:KIND",  # DeepSeek-V3 / Kimi-K2.5's latent attention
}
DEFAULT_KIND = "llama"  # the kind an export no other kind's format recognises is judged by (drafter/formats)


@dataclass(frozen=True)
class AttentionMemory:
    """A kind's attention in ``drafter/training/memory_plan.py``: ``kernel(cfg, device_type)`` ("math"
    or "fused"), ``step_bytes(cfg, s, c, kernel)`` (what TTT step ``s`` keeps per token, ``c`` the
    compute dtype's size) and ``kept_keys_bytes(cfg, c)`` (per token, kept for later steps under
    recomputation)."""

    kernel: Callable[[Any, str], str]
    step_bytes: Callable[[Any, int, int, str], int]
    kept_keys_bytes: Callable[[Any, int], int]


@dataclass(frozen=True)
class DrafterKind:
    """What one kind of drafter provides.

    - ``attention``: built from a ``DrafterConfig``; ``attention.rotary(cfg)`` gives the cos/sin
      module and ``attn(x, cos, sin, context)`` runs it in a ``drafter/contexts.py`` context;
    - ``target_shape(text_config) -> dict``: the target's sizes it copies (``DrafterConfig.mla``),
      None for a kind that copies none;
    - ``layout_problems(shape) -> {recipe key: problem}``: options of a ``DraftShape`` no export of
      this kind would serve as trained (each engine's own refusals are its format's);
    - ``target_notes(target_config) -> [note]``: what to note of this target for the kind (raises
      when the target cannot take this kind at all; each engine's notes are its format's);
    - ``memory``: its attention's terms in the training memory estimate (``AttentionMemory``);
      None: the estimate's own Llama GQA terms (q, k, v of ``head_dim``) fit it.
    """

    name: str
    attention: type
    target_shape: Callable[[dict], dict] | None
    layout_problems: Callable[[Any], dict[str, str]]
    target_notes: Callable[[dict], list[str]]
    memory: AttentionMemory | None = None


def kind_names() -> tuple[str, ...]:
    return tuple(KINDS)


def get_kind(name: str) -> DrafterKind:
    if name not in KINDS:
        raise ValueError(f"unknown drafter kind {name!r}; the registered kinds are {sorted(KINDS)}")
    module, _, attr = KINDS[name].partition(":")
    kind = getattr(importlib.import_module(module), attr)
    if kind.name != name:
        raise ValueError(f"{KINDS[name]} registers kind {kind.name!r}, not {name!r}")
    return kind
