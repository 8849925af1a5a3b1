"""The serving formats of a drafter, one module per (drafter kind, engine), listed once in ``FORMATS``.

A drafter's export is a matrix: each kind (``drafter/kinds``) is written differently for each
serving engine (config keys, weight names, the engine's layer numbering). Each cell is one module
that builds a :class:`ServingFormat`: it writes the export, reads it back, checks it, and says which
recipe options that engine's release would not serve as trained. Everything outside this package
asks the registry (``for_``, ``export``, ``load``, ``check``) and never names an engine, so a new
engine, or a new kind, is a module per cell plus one line each in ``FORMATS``.

The entries are ``"module:name"`` strings resolved on first use, as ``KINDS`` and the engines'
``ROLES`` are: the formats import the model, which the registry's callers import too.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# (kind, engine) -> "module:attribute" of its ServingFormat; the engines in first-seen order are the
# export order (the evaluator loads the first export a drafter has)
FORMATS: dict[tuple[str, str], str] = {
    ("llama", "sglang"): "eagle3_assets.drafter.formats.llama_sglang:FORMAT",  # LlamaForCausalLMEagle3
    ("llama", "vllm"): "eagle3_assets.drafter.formats.llama_vllm:FORMAT",  # a speculators Eagle3Speculator
    ("mla", "sglang"): "eagle3_assets.drafter.formats.mla_sglang:FORMAT",  # Eagle3DeepseekV2ForCausalLM
    ("mla", "vllm"): "eagle3_assets.drafter.formats.mla_vllm:FORMAT",  # the same, in vLLM's numbering
}


@dataclass(frozen=True)
class ServingFormat:
    """One kind's export for one engine.

    - ``export(model, out_dir, *, dtype, verifier, verifier_architectures, speculative_tokens) -> Path``
      (a format without a speculators config ignores the last three);
    - ``load(export_dir, embeddings) -> Eagle3Drafter``: rebuilt from the files (``embeddings`` None:
      the export's own, where it carries them);
    - ``check(export_dir) -> [problem]``: what the engine's loader would refuse or misread;
    - ``recognises(config_json) -> bool``: an export's ``config.json`` is this format's;
    - ``aux_ids(config_json)``: the aux layer ids the engine reads from it, in its own numbering;
    - ``switch_readers``: EAGLE 3.1 switch -> the module of the pinned release that reads it for this
      kind (a switch missing here is refused for a recipe naming this engine);
    - ``refuses(shape) -> {recipe key: problem}``: other options of a ``DraftShape`` it would run
      differently from what was trained;
    - ``target_notes(target_config) -> [note]``: what the engine will not serve with this target.
    """

    kind: str
    engine: str
    export: Callable[..., Path]
    load: Callable[..., Any]
    check: Callable[[Path], list[str]]
    recognises: Callable[[dict], bool]
    aux_ids: Callable[[dict], Any]
    switch_readers: dict[str, str] = field(default_factory=dict)
    refuses: Callable[[Any], dict[str, str]] = lambda shape: {}
    target_notes: Callable[[dict], list[str]] = lambda target_config: []


def serving_engines() -> tuple[str, ...]:
    """Every engine a format is registered for, in registry order (a recipe's ``engines`` choice)."""
    return tuple(dict.fromkeys(engine for _, engine in FORMATS))


def for_(kind: str, engine: str) -> ServingFormat:
    if (kind, engine) not in FORMATS:
        raise ValueError(f"no serving format for drafter kind {kind!r} on engine {engine!r}; the registered ones: "
                         f"{sorted(FORMATS)}")
    module, _, attr = FORMATS[kind, engine].partition(":")
    fmt = getattr(importlib.import_module(module), attr)
    if (fmt.kind, fmt.engine) != (kind, engine):
        raise ValueError(f"{FORMATS[kind, engine]} registers {(fmt.kind, fmt.engine)}, not {(kind, engine)}")
    return fmt


def _config(export_dir: Path) -> dict:
    return json.loads((Path(export_dir) / "config.json").read_text())


def of_export(config: dict, engine: str) -> ServingFormat:
    """The format of ``engine`` whose export ``config`` (a ``config.json``) is; the default kind's when
    no other kind's format recognises it (its errors then name what is wrong)."""
    from eagle3_assets.drafter.kinds import DEFAULT_KIND

    for kind, eng in FORMATS:
        if eng == engine and kind != DEFAULT_KIND and for_(kind, engine).recognises(config):
            return for_(kind, engine)
    return for_(DEFAULT_KIND, engine)


def export(engine: str, model, out_dir: Path, **options) -> Path:
    """``engine``'s serving files of ``model`` (in the format of its kind, ``model.config.attention``)."""
    return for_(model.config.attention, engine).export(model, out_dir, **options)


def load(engine: str, export_dir: Path, embeddings=None):
    """The drafter rebuilt from ``engine``'s export (the target's ``embeddings``, or the export's own)."""
    return of_export(_config(export_dir), engine).load(Path(export_dir), embeddings)


def file_problems(engine: str, export_dir: Path) -> list[str]:
    """Problems with ``engine``'s export files (empty when its loader reads them as trained)."""
    export_dir = Path(export_dir)
    if not (export_dir / "config.json").exists() or not (export_dir / "model.safetensors").exists():
        return [f"{export_dir}: config.json or model.safetensors is missing"]
    return of_export(_config(export_dir), engine).check(export_dir)


def layer_problems(engine: str, export_dir: Path, layers: dict | None) -> list[str]:
    """The export's aux ids against the training layers (nothing to compare when ``layers`` is None
    or the config is unreadable: the format checks report that)."""
    from eagle3_assets.drafter.trained_layers import layer_id_problems

    cfg_path = Path(export_dir) / "config.json"
    if layers is None or not cfg_path.exists():
        return []
    cfg = json.loads(cfg_path.read_text())
    return layer_id_problems(of_export(cfg, engine).aux_ids(cfg), layers, engine, "config.json")


def check(engine: str, export_dir: Path, trained: dict | None = None) -> list[str]:
    """Problems with ``engine``'s export files, and with its aux layer ids against ``trained`` (the
    training shards' ``layers`` record) when given."""
    return file_problems(engine, export_dir) + layer_problems(engine, export_dir, trained)


def layout_problems(shape) -> dict[str, str]:
    """``{recipe key: problem}`` for the options of ``shape`` (a ``DraftShape``) that its kind, or one of
    its ``engines``, would not serve as trained: the kind's own refusals first, then each engine's."""
    from eagle3_assets.drafter.export_files import unread_switches
    from eagle3_assets.drafter.kinds import get_kind

    own = get_kind(shape.attention).layout_problems(shape)
    if own:
        return own
    missing = [e for e in shape.engines if (shape.attention, e) not in FORMATS]
    if missing:
        return {"engines": f"{missing} have no serving format for attention {shape.attention!r}"}
    fmts = [for_(shape.attention, e) for e in shape.engines]
    readers = {}
    for fmt in fmts:
        for key, module in fmt.switch_readers.items():
            readers.setdefault(key, {})[fmt.engine] = module
    refused = {key: why for fmt in fmts for key, why in fmt.refuses(shape).items()}
    return {**refused, **unread_switches(shape, readers)}


def target_notes(kind: str, target_config: dict) -> list[str]:
    """What the kind says of this target (it raises when it cannot take it), then each engine's notes."""
    from eagle3_assets.drafter.kinds import get_kind

    notes = get_kind(kind).target_notes(target_config)
    return notes + [n for k, e in FORMATS if k == kind for n in for_(k, e).target_notes(target_config)]


def evaluated_export_dir(drafter_dir: Path) -> Path:
    """The export the evaluator loads: the first engine's (registry order) that was written, else the last's."""
    engines = serving_engines()
    return Path(drafter_dir) / next((e for e in engines if (Path(drafter_dir) / e / "config.json").exists()), engines[-1])
