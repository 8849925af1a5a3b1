"""Disk arithmetic for hidden states: bytes per token, what a corpus will take, and a refusal to
start when the filesystem cannot hold it (at Kimi-K2.5's width, 57 KB per token in bf16)."""

from __future__ import annotations

import shutil
from pathlib import Path

DTYPES = ("bf16", "fp8")
_PER_SAMPLE_OVERHEAD = 128  # offsets entry, id in the shard header, index row
_FIXED_OVERHEAD = 1 << 20  # manifest, index footer, progress file, shard headers


class InsufficientDiskSpace(OSError):
    pass


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"hidden-state dtype must be one of {DTYPES}, got {dtype!r}")
    return dtype


def bytes_per_token(hidden: int, dtype: str = "bf16", n_aux: int = 3) -> int:
    """Shard bytes per token: the hidden states, fp8 scales, the id (int32) and mask (int8)."""
    width = (n_aux + 1) * hidden
    states = width * 2 if check_dtype(dtype) == "bf16" else width + 2 * 4
    return states + 4 + 1


def estimate_bytes(n_tokens: int, hidden: int, dtype: str = "bf16", n_samples: int = 0, n_aux: int = 3) -> int:
    """Disk needed for ``n_tokens`` tokens in ``n_samples`` samples, overheads included."""
    return n_tokens * bytes_per_token(hidden, dtype, n_aux) + n_samples * _PER_SAMPLE_OVERHEAD + _FIXED_OVERHEAD


def _existing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def preflight(path: Path | str, estimate: int, margin: float = 0.1) -> dict:
    """Refuse to start when the filesystem holding ``path`` lacks ``estimate * (1 + margin)``."""
    need = int(estimate * (1 + margin))
    where = _existing(Path(path))
    free = shutil.disk_usage(where).free
    if free < need:
        raise InsufficientDiskSpace(
            f"not enough disk for hidden states at {path}: need {need:,} bytes "
            f"({estimate:,} estimated + {margin:.0%} margin), only {free:,} free on {where}"
        )
    return {"path": str(path), "need_bytes": need, "free_bytes": free}
