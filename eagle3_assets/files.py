"""Small file helpers: atomic Parquet writes so readers never see half a file."""

from __future__ import annotations

import os
from pathlib import Path

import polars as pl


def write_parquet_atomic(frame: pl.DataFrame, path: Path) -> int:
    """Write ``frame`` to ``path`` through a temporary file and a rename; returns bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    frame.write_parquet(tmp, compression="zstd")
    os.replace(tmp, path)
    return path.stat().st_size
