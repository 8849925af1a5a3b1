"""The sweep's journal: one JSON line per measured cell, appended and fsync'd as each finishes.

A cell's line carries its cache key (:func:`eagle3_assets.serving.provenance.cell_key`: the export's
sha256, the engine and its version, the setting, the concurrency, the benchmark's hash, the machine).
A re-run, after a server died or a new materialization, measures only the cells whose key has no
line yet: cells of a changed export get new keys and run again; unchanged ones are reused. A torn
last line (a crash mid-write) is dropped when read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class Journal:
    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.entries: dict[str, dict] = {}
        if self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line
                if isinstance(entry, dict) and "key" in entry:
                    self.entries[entry["key"]] = entry

    def has(self, key: str) -> bool:
        return key in self.entries

    def get(self, key: str) -> dict | None:
        return self.entries.get(key)

    def add(self, entry: dict) -> None:
        if "key" not in entry:
            raise ValueError("a journal entry needs its cache key")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(entry, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.entries[entry["key"]] = entry
