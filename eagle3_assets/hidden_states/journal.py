"""The hidden-state directory's journal: ``progress.jsonl``, one fsync'd JSON line per finished
shard or quarantined sample, read back whole lines only (a crash mid-append tears the last one)."""

from __future__ import annotations

import json
import time
from pathlib import Path


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def read_progress(path: Path) -> list[dict]:
    """Complete records of the progress file; a torn last line (crash mid-append) is cut off."""
    if not path.exists():
        return []
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep < len(data):
        with path.open("r+b") as fh:
            fh.truncate(keep)
    return [json.loads(line) for line in data[:keep].decode("utf-8").splitlines() if line.strip()]
