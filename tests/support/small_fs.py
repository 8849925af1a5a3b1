"""A real filesystem of a few megabytes, mounted for one test: a disk that fills for real.

``mount -t tmpfs -o size=N`` needs root (or CAP_SYS_ADMIN); ``can_mount`` tries it once, and
tests marked ``mount`` are skipped where it fails (failed under CI=true, see NEEDS in
tests/conftest.py). The filesystem's free space is what ``statvfs`` reports, and a write past
it fails with ENOSPC, as on a full disk.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from pathlib import Path


def _mount(where: Path, size_bytes: int) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size_bytes)}", "eagle3-test-fs", str(where)],
                          capture_output=True, text=True)


def can_mount() -> str | None:
    """``mount`` when a small tmpfs mounts here, else None."""
    if not shutil.which("mount") or not shutil.which("umount"):
        return None
    with tempfile.TemporaryDirectory() as d:
        if _mount(Path(d), 1 << 20).returncode != 0:
            return None
        subprocess.run(["umount", d], capture_output=True)
    return "mount -t tmpfs (root)"


@contextlib.contextmanager
def small_filesystem(where: Path, size_bytes: int):
    """A tmpfs of ``size_bytes`` mounted at ``where`` for the block, unmounted after."""
    where = Path(where)
    where.mkdir(parents=True, exist_ok=True)
    done = _mount(where, size_bytes)
    if done.returncode != 0:
        raise RuntimeError(f"mount of a {size_bytes:,}-byte tmpfs at {where} failed: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(folder: Path, leave: int = 0) -> Path:
    """Fill ``folder``'s filesystem to ``leave`` free bytes with one ballast file (another process's data)."""
    ballast = Path(folder) / "ballast"
    free = shutil.disk_usage(folder).free
    with open(ballast, "ab") as fh:
        try:
            fh.write(b"\0" * max(0, free - leave))
        except OSError:
            pass
    return ballast
