"""Drafter training recipes: one TOML file per recipe, bundled or under ``<data root>/recipes/``.

A recipe names the datasets it trains on (with mixing weights) and, as flat keys, the
drafter's shape, the training settings and the evaluation settings; each key belongs to one
of the typed sections in :mod:`eagle3_assets.drafter.training.config`, where its default
and limits are defined. It is the ``recipe`` partition of the ``drafter_checkpoint`` asset,
so it is validated up front and every error names the file and the field: a typo must fail
before any GPU time is spent, not after.

Dataset weights scale a dataset's share of each epoch: 1.0 uses every sample once, 0.5 a
seeded random half, 2.0 every sample twice.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from eagle3_assets.drafter.training.config import DraftShape, EvalSettings, TrainSettings
from eagle3_assets.errors import UserInputError
from eagle3_assets.paths import BUNDLED, DATASET_NAME, DataLayout

SECTIONS = {"shape": DraftShape, "training": TrainSettings, "evaluation": EvalSettings}
RECIPE_KEYS = ("datasets", "description", "name")


class RecipeError(UserInputError):
    """A recipe file that cannot be used (or no such recipe); the message names the file and the field."""


@dataclass(frozen=True)
class Recipe:
    name: str
    datasets: dict[str, float]  # dataset -> mixing weight
    shape: DraftShape
    training: TrainSettings
    evaluation: EvalSettings
    description: str = ""


def _section_of(key: str) -> str | None:
    for section, model in SECTIONS.items():
        if key in model.model_fields:
            return section
    return None


def known_keys() -> list[str]:
    return sorted({*RECIPE_KEYS, *(k for model in SECTIONS.values() for k in model.model_fields)})


def _fail(source: str, key: str, msg: str, value=None):
    got = "" if value is None else f", got {value!r}"
    raise RecipeError(f"{source}: field '{key}': {msg}{got}")


def _explain(source: str, raw: dict, exc: ValidationError):
    """The first pydantic error as ``file: field 'key': message, got value``."""
    err = exc.errors()[0]
    msg = err["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
    if err["loc"]:
        key = str(err["loc"][0])
    else:  # a cross-field rule: its message quotes the field first
        quoted = re.search(r"'(\w+)'", msg)
        key = quoted.group(1) if quoted else "?"
        msg = msg.removeprefix(f"'{key}' ")
    _fail(source, key, msg, raw.get(key))


def _datasets(source: str, ds) -> dict[str, float]:
    if not isinstance(ds, dict) or not ds:
        _fail(source, "datasets", "must be a non-empty table of dataset = weight", ds)
    out = {}
    for name, w in ds.items():
        if not DATASET_NAME.match(name):
            _fail(source, f"datasets.{name}", "is not a usable dataset name (letters, digits, '_', '-', '.')")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            _fail(source, f"datasets.{name}", "must be a finite number > 0", w)
        out[name] = float(w)
    return out


def recipe_from_table(source: str, name: str, raw: dict) -> Recipe:
    """Validate a flat recipe table (TOML keys) into a :class:`Recipe`."""
    raw = dict(raw)
    sections: dict[str, dict] = {s: {} for s in SECTIONS}
    for key in raw:
        if key in RECIPE_KEYS:
            continue
        section = _section_of(key)
        if section is None:
            _fail(source, key, f"unknown field (known: {', '.join(known_keys())})")
        sections[section][key] = raw[key]
    if "datasets" not in raw:
        _fail(source, "datasets", "is required")
    if "draft_vocab_size" not in raw:
        _fail(source, "draft_vocab_size", "is required")
    if "name" in raw and raw["name"] != name:
        _fail(source, "name", f"must match the file name {name!r} (or be left out)")
    description = raw.get("description", "")
    if not isinstance(description, str):
        _fail(source, "description", "must be a string", description)
    datasets = _datasets(source, raw["datasets"])
    built = {}
    for section, model in SECTIONS.items():
        try:
            built[section] = model.model_validate(sections[section])
        except ValidationError as exc:
            _explain(source, raw, exc)
    return Recipe(name=name, datasets=datasets, description=description, **built)


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
    return recipe_from_table(source, name, raw)


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
