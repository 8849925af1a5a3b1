"""Small file helpers: atomic writes so readers never see half a file, durable where a crash must not lose them."""

from __future__ import annotations

import os
from pathlib import Path

import polars as pl


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` survive a crash (best effort where a filesystem refuses)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """``text`` to ``path`` through a temporary file, fsync'd, renamed into place, the folder fsync'd."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_parquet_atomic(frame: pl.DataFrame, path: Path, metadata: dict[str, str] | None = None) -> int:
    """Write ``frame`` to ``path`` through a temporary file and a rename (``metadata``: the file's
    key-value metadata); returns bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    frame.write_parquet(tmp, compression="zstd", metadata=metadata)
    os.replace(tmp, path)
    return path.stat().st_size
