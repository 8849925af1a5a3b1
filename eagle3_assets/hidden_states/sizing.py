"""Disk arithmetic for hidden states: bytes per token, what a corpus will take, and a refusal to
start when the filesystem cannot hold it (at Kimi-K2.5's width, 57 KB per token in bf16)."""

from __future__ import annotations

from pathlib import Path

from eagle3_assets.files import InsufficientDiskSpace, require_free

DTYPES = ("bf16", "fp8")
_PER_SAMPLE_OVERHEAD = 128  # offsets entry, id in the shard header, index row
_FIXED_OVERHEAD = 1 << 20  # manifest, index footer, progress file, shard headers


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


def preflight(path: Path | str, estimate: int, margin: float = 0.1) -> dict:
    """Refuse to start when the filesystem holding ``path`` lacks ``estimate * (1 + margin)``."""
    return require_free(path, estimate, "hidden states", margin=margin)


__all__ = ["DTYPES", "InsufficientDiskSpace", "bytes_per_token", "check_dtype", "estimate_bytes", "preflight"]
