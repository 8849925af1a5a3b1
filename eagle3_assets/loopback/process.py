"""A loopback server in its own process, as the benchmarks run it: the client under test does not
share the server's CPU-bound event loop, and the server's figures come from a separate record."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from eagle3_assets.paths import REPO_ROOT


@contextmanager
def loopback_process(*args: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """``python -m eagle3_assets.loopback ARGS`` until the block ends; yields (process, url)."""
    cmd = [sys.executable, "-m", "eagle3_assets.loopback", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT)
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        proc.kill()
        raise RuntimeError(f"loopback server did not start: {line}{proc.stdout.read()}")
    try:
        yield proc, line.split()[2]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
