"""Drafter training recipes: one TOML file per recipe, bundled or under ``<data root>/recipes/``.

A recipe names the datasets it trains on (with mixing weights), the drafter's shape, and the
training and evaluation settings. It is the ``recipe`` partition of the ``drafter_checkpoint``
asset, so it is validated up front and every error names the file and the field: a typo must
fail before any GPU time is spent, not after.

Dataset weights scale a dataset's share of each epoch: 1.0 uses every sample once, 0.5 a
seeded random half, 2.0 every sample twice.
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

from eagle3_assets.paths import BUNDLED, DATASET_NAME, DataLayout

SCHEDULES = ("cosine", "constant")


class RecipeError(ValueError):
    """A recipe file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class Recipe:
    name: str
    datasets: dict[str, float]  # dataset -> mixing weight
    draft_vocab_size: int
    description: str = ""
    # drafter shape (hidden size and heads always follow the target)
    intermediate_size: int | None = None  # None: the target's
    aux_layer_ids: list[int] | None = None  # None: [1, L//2 - 1, L - 4]
    # training-time test
    ttt_steps: int = 7
    step_loss_decay: float = 0.8
    # optimizer and schedule
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: str = "cosine"
    grad_clip: float = 0.5  # 0 turns clipping off
    # length of training: exactly one of the two
    max_steps: int | None = None
    epochs: float | None = None
    batch_size: int = 8  # global: split across data-parallel ranks
    max_length: int = 2048  # tokens per sequence; longer samples are truncated
    seed: int = 0
    checkpoint_every: int = 500
    # evaluation by real speculative decoding on held-out prompts
    acceptance_floor: float = 1.0  # SGLang convention: accepted draft tokens + 1 per verification
    eval_max_new_tokens: int = 64
    eval_samples: int = 16
    speculative_k: int = 3

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# ----------------------------------------------------------------------------- validation


def _fail(source: str, key: str, msg: str, value=None):
    got = "" if value is None else f", got {value!r}"
    raise RecipeError(f"{source}: field '{key}': {msg}{got}")


def _int(source, key, v, lo=None):
    if isinstance(v, bool) or not isinstance(v, int):
        _fail(source, key, "must be an integer", v)
    if lo is not None and v < lo:
        _fail(source, key, f"must be >= {lo}", v)
    return v


def _float(source, key, v, lo=None, hi=None, lo_open=False, hi_open=False):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        _fail(source, key, "must be a finite number", v)
    v = float(v)
    if lo is not None and (v < lo or (lo_open and v == lo)):
        _fail(source, key, f"must be {'>' if lo_open else '>='} {lo}", v)
    if hi is not None and (v > hi or (hi_open and v == hi)):
        _fail(source, key, f"must be {'<' if hi_open else '<='} {hi}", v)
    return v


def _check(source: str, raw: dict) -> dict:
    """Type- and range-check the raw TOML table; returns Recipe keyword arguments."""
    known = {f.name for f in fields(Recipe)}
    for key in raw:
        if key not in known:
            _fail(source, key, f"unknown field (known: {', '.join(sorted(known))})")
    for key in ("datasets", "draft_vocab_size"):
        if key not in raw:
            _fail(source, key, "is required")
    out: dict = {}
    ds = raw["datasets"]
    if not isinstance(ds, dict) or not ds:
        _fail(source, "datasets", "must be a non-empty table of dataset = weight", ds)
    out["datasets"] = {}
    for name, w in ds.items():
        if not DATASET_NAME.match(name):
            _fail(source, f"datasets.{name}", "is not a usable dataset name (letters, digits, '_', '-', '.')")
        out["datasets"][name] = _float(source, f"datasets.{name}", w, lo=0.0, lo_open=True)
    out["draft_vocab_size"] = _int(source, "draft_vocab_size", raw["draft_vocab_size"], lo=1)
    if "description" in raw:
        if not isinstance(raw["description"], str):
            _fail(source, "description", "must be a string", raw["description"])
        out["description"] = raw["description"]
    if raw.get("intermediate_size") is not None:
        out["intermediate_size"] = _int(source, "intermediate_size", raw["intermediate_size"], lo=1)
    if raw.get("aux_layer_ids") is not None:
        ids = raw["aux_layer_ids"]
        if not isinstance(ids, list) or len(ids) != 3:
            _fail(source, "aux_layer_ids", "must be a list of three layer ids", ids)
        out["aux_layer_ids"] = [_int(source, "aux_layer_ids", i, lo=0) for i in ids]
        if sorted(set(ids)) != ids:
            _fail(source, "aux_layer_ids", "must be strictly increasing", ids)
    ints = {"ttt_steps": 1, "warmup_steps": 0, "batch_size": 1, "max_length": 8, "seed": 0,
            "checkpoint_every": 1, "eval_max_new_tokens": 1, "eval_samples": 1, "speculative_k": 1}
    for key, lo in ints.items():
        if key in raw:
            out[key] = _int(source, key, raw[key], lo=lo)
    if "step_loss_decay" in raw:
        out["step_loss_decay"] = _float(source, "step_loss_decay", raw["step_loss_decay"], lo=0.0, hi=1.0, lo_open=True)
    if "lr" in raw:
        out["lr"] = _float(source, "lr", raw["lr"], lo=0.0, lo_open=True)
    if "weight_decay" in raw:
        out["weight_decay"] = _float(source, "weight_decay", raw["weight_decay"], lo=0.0)
    if "grad_clip" in raw:
        out["grad_clip"] = _float(source, "grad_clip", raw["grad_clip"], lo=0.0)
    if "acceptance_floor" in raw:
        out["acceptance_floor"] = _float(source, "acceptance_floor", raw["acceptance_floor"], lo=1.0)
    if "betas" in raw:
        b = raw["betas"]
        if not isinstance(b, list) or len(b) != 2:
            _fail(source, "betas", "must be a list of two numbers", b)
        out["betas"] = tuple(_float(source, "betas", x, lo=0.0, hi=1.0, hi_open=True) for x in b)
    if "schedule" in raw:
        if raw["schedule"] not in SCHEDULES:
            _fail(source, "schedule", f"must be one of {', '.join(SCHEDULES)}", raw["schedule"])
        out["schedule"] = raw["schedule"]
    has_steps, has_epochs = raw.get("max_steps") is not None, raw.get("epochs") is not None
    if has_steps == has_epochs:
        _fail(source, "max_steps", "set exactly one of 'max_steps' and 'epochs'")
    if has_steps:
        out["max_steps"] = _int(source, "max_steps", raw["max_steps"], lo=1)
    else:
        out["epochs"] = _float(source, "epochs", raw["epochs"], lo=0.0, lo_open=True)
    if out.get("warmup_steps", 0) and has_steps and out["warmup_steps"] >= out["max_steps"]:
        _fail(source, "warmup_steps", f"must be below max_steps ({out['max_steps']})", out["warmup_steps"])
    return out


# ----------------------------------------------------------------------------- files and registry


BUNDLED_RECIPES = BUNDLED / "recipes"


def recipes_dir() -> Path:
    """The user's recipes: ``$EAGLE3_RECIPES`` when set, else ``recipes/`` under the data root."""
    env = os.environ.get("EAGLE3_RECIPES")
    return Path(env).expanduser() if env else DataLayout.from_env().root / "recipes"


def _recipe_dirs(directory: Path | None) -> list[Path]:
    """Where recipes are looked up, first match wins: the given directory alone, else the user's
    directory, then the recipes bundled with the package (``demo``)."""
    return [Path(directory)] if directory else [recipes_dir(), BUNDLED_RECIPES]


def parse_recipe(path: Path) -> Recipe:
    """Load and validate one recipe file; the name is the file's stem."""
    path = Path(path)
    source = str(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RecipeError(f"{source}: no such recipe file") from None
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{source}: not valid TOML: {exc}") from None
    name = path.stem
    if not DATASET_NAME.match(name):
        raise RecipeError(f"{source}: the file name {name!r} is not usable as a recipe (partition) name")
    if "name" in raw:
        if raw.pop("name") != name:
            _fail(source, "name", f"must match the file name {name!r} (or be left out)")
    return Recipe(name=name, **_check(source, raw))


def list_recipes(directory: Path | None = None) -> list[str]:
    """Names of the recipe files (valid or not), sorted."""
    return sorted({p.stem for d in _recipe_dirs(directory) if d.is_dir() for p in d.glob("*.toml")})


def load_recipe(name: str, directory: Path | None = None) -> Recipe:
    dirs = _recipe_dirs(directory)
    for d in dirs:
        if (d / f"{name}.toml").exists():
            return parse_recipe(d / f"{name}.toml")
    known = ", ".join(list_recipes(directory)) or "none"
    raise RecipeError(f"{dirs[0] / f'{name}.toml'}: no recipe named {name!r} (known: {known})")
