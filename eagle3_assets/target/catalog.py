"""Targets the project can build by itself, by name, next to any local checkpoint directory."""

from __future__ import annotations

from pathlib import Path

from eagle3_assets.target.embedded import ensure_default_model
from eagle3_assets.target.kimi_mini import ensure_kimi_mini

# name -> builder(models_dir) -> checkpoint directory (built once, then cached)
BUILTIN = {"smollm2": ensure_default_model, "kimi-mini": ensure_kimi_mini}
# what each bundled target needs from the TargetResource (kimi-mini loads its tokenizer as remote code)
BUILTIN_SETTINGS = {"kimi-mini": {"trust_remote_code": True}}
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
