"""Small file helpers: atomic writes so readers never see half a file, durable where a crash must not lose them,
and the one disk-space mechanism every stage writes through.

A full disk is met twice. Before a write, :func:`require_free` compares what it will write with the
free space of the filesystem that will hold it and refuses, naming the folder and both figures.
A write that still runs out of space (another process filled the disk meanwhile, or the estimate
was short) raises :class:`DiskFull` naming the file it was writing, at once: :func:`atomic_path`
writes through a temporary sibling, so the file already there is untouched and the temporary
one is removed, giving its space back.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
from pathlib import Path

import polars as pl

_FULL = (errno.ENOSPC, errno.EDQUOT)


class InsufficientDiskSpace(OSError):
    """Refused before writing: the filesystem cannot hold what the step is about to write."""


class DiskFull(OSError):
    """A write ran out of space (ENOSPC, or a quota); the message names the file being written."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def existing_parent(path: Path | str) -> Path:
    """``path`` or its nearest existing ancestor: where the filesystem that will hold it is mounted."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path | str) -> int:
    """Bytes an unprivileged writer can still write on the filesystem that holds (or will hold) ``path``."""
    return shutil.disk_usage(existing_parent(path)).free


def require_free(path: Path | str, need: int, what: str, *, margin: float = 0.0, held: int = 0) -> dict:
    """Refuse (:class:`InsufficientDiskSpace`) when the filesystem of folder ``path`` lacks room for
    ``need`` bytes (+ ``margin``); ``held``: bytes of those already on disk there (a spool's units), which
    count as room. Returns the figures for the step's metadata."""
    want = int(need * (1 + margin))
    where = existing_parent(path)
    free = shutil.disk_usage(where).free
    if free + held < want:
        extra = f" ({need:,} estimated + {margin:.0%} margin)" if margin else ""
        also = f" + {held:,} it holds already" if held else ""
        raise InsufficientDiskSpace(f"not enough disk for {what} at {path}: need {want:,} bytes{extra}, "
                                    f"only {free:,} free{also} on {where}")
    return {"path": str(path), "need_bytes": want, "free_bytes": free}


def is_disk_full(exc: BaseException) -> bool:
    """A refusal for want of space, or a write that ran out of it."""
    return isinstance(exc, (InsufficientDiskSpace, DiskFull)) or (isinstance(exc, OSError) and exc.errno in _FULL)


@contextlib.contextmanager
def disk_full_names(path: Path | str):
    """Turn a full disk met inside the block into :class:`DiskFull` naming ``path`` and the space left."""
    try:
        yield
    except DiskFull:
        raise
    except OSError as exc:
        if exc.errno not in _FULL:
            raise
        raise DiskFull(exc.errno, f"disk full writing {path}: {exc.strerror}; {free_bytes(path):,} bytes free "
                                  f"on {existing_parent(Path(path).parent)}") from exc


@contextlib.contextmanager
def atomic_path(path: Path | str, *, need: int = 0, what: str | None = None):
    """A temporary sibling of ``path`` to write; renamed into place when the block ends, removed when it
    raises. ``need``: bytes the write takes, checked against the free space first (0: no check)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if need > 0:
        require_free(path.parent, need, what or path.name)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with disk_full_names(path):
            yield tmp
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


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
    data = text.encode("utf-8")
    with atomic_path(path, need=len(data)) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    fsync_dir(path.parent)


def write_parquet_atomic(frame: pl.DataFrame, path: Path, metadata: dict[str, str] | None = None) -> int:
    """Write ``frame`` to ``path`` through a temporary file and a rename (``metadata``: the file's
    key-value metadata); returns bytes. The file is made in memory first (no larger than the frame:
    zstd), so the preflight checks its exact size."""
    path = Path(path)
    buf = io.BytesIO()
    frame.write_parquet(buf, compression="zstd", metadata=metadata)
    data = buf.getbuffer()
    with atomic_path(path, need=len(data)) as tmp, open(tmp, "wb") as fh:
        fh.write(data)
    return path.stat().st_size
