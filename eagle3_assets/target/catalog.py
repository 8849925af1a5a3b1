"""Targets the project can build by itself, by name, next to any local checkpoint directory."""

from __future__ import annotations

from pathlib import Path

from eagle3_assets.target.embedded import ensure_default_model

# name -> builder(models_dir) -> checkpoint directory (built once, then cached)
BUILTIN = {"smollm2": ensure_default_model}
DEFAULT = "smollm2"


def resolve_model_dir(model: str, models_dir: Path) -> Path:
    """A bundled target's cached directory (built on first use) or a local checkpoint directory."""
    key = model or DEFAULT
    if key in BUILTIN:
        return BUILTIN[key](Path(models_dir))
    path = Path(key).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"target model {model!r} is neither a bundled target ({', '.join(sorted(BUILTIN))}) "
            "nor a directory with a config.json")
    return path
