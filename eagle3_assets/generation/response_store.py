"""The append-only response files of one dataset: ``responses/<dataset>/<source>.jsonl``.

One writer per file appends whole lines and fsyncs each batch, so a crash can only leave a
torn last line, which is detected and cut off before the next append. Resume asks which
sample ids are already present in *any* source; nothing here counts lines.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

SOURCES = ("local", "sglang", "openrouter")

# The response row contract (the README's "The graph"); writers fill every key.
RESPONSE_FIELDS = (
    "sample_id", "dataset", "prompt_id", "sample_index", "source", "model", "provider",
    "prompt_ids", "output_ids", "text", "reasoning", "finish_reason",
    "prompt_tokens", "completion_tokens", "reasoning_tokens", "cost_usd", "latency_s", "attempts", "created_at",
    "native_finish_reason", "generation_id", "flags",
)


class CorruptResponseFile(ValueError):
    """A complete line in a response file that is not a valid row."""


def _complete_length(path: Path) -> int:
    """Byte length of the file up to and including its last newline."""
    size = path.stat().st_size
    if size == 0:
        return 0
    with path.open("rb") as fh:
        block = 1 << 16
        pos = size
        while pos > 0:
            start = max(0, pos - block)
            fh.seek(start)
            chunk = fh.read(pos - start)
            idx = chunk.rfind(b"\n")
            if idx >= 0:
                return start + idx + 1
            pos = start
    return 0


class ResponseStore:
    """Reads and appends the response rows of one dataset, across sources."""

    def __init__(self, directory: Path | str):
        self.dir = Path(directory)

    def path(self, source: str) -> Path:
        return self.dir / f"{source}.jsonl"

    @property
    def errors_path(self) -> Path:
        return self.dir / "errors.jsonl"

    def source_files(self) -> list[Path]:
        if not self.dir.is_dir():
            return []
        return sorted(p for p in self.dir.glob("*.jsonl") if p.name != "errors.jsonl")

    def torn_bytes(self, source: str) -> int:
        p = self.path(source)
        return p.stat().st_size - _complete_length(p) if p.exists() else 0

    def drop_torn_tail(self, source: str) -> int:
        """Cut an incomplete last line left by a crash; returns the bytes removed."""
        p = self.path(source)
        if not p.exists():
            return 0
        keep = _complete_length(p)
        torn = p.stat().st_size - keep
        if torn:
            with p.open("r+b") as fh:
                fh.truncate(keep)
                fh.flush()
                os.fsync(fh.fileno())
        return torn

    def iter_rows(self, sources: Iterable[str] | None = None) -> Iterator[dict]:
        """Complete rows of the given sources (all by default); a torn last line is ignored."""
        files = [self.path(s) for s in sources] if sources else self.source_files()
        for p in files:
            if not p.exists():
                continue
            keep = _complete_length(p)
            with p.open("rb") as fh:
                data = fh.read(keep)
            for line_no, raw in enumerate(data.splitlines(), start=1):
                if not raw.strip():
                    continue
                try:
                    row = json.loads(raw)
                except json.JSONDecodeError as e:
                    raise CorruptResponseFile(f"{p}, line {line_no}: not valid JSON ({e.msg})") from None
                if not isinstance(row, dict) or "sample_id" not in row:
                    raise CorruptResponseFile(f"{p}, line {line_no}, field 'sample_id': missing")
                yield row

    def rows(self, sources: Iterable[str] | None = None) -> list[dict]:
        return list(self.iter_rows(sources))

    def finished_ids(self) -> set[str]:
        return {r["sample_id"] for r in self.iter_rows()}

    def writer(self, source: str) -> ResponseWriter:
        return ResponseWriter(self, source)

    def append_error(self, record: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with self.errors_path.open("ab") as fh:
            fh.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
            fh.flush()
            os.fsync(fh.fileno())


class ResponseWriter:
    """The single writer of one source file; use as a context manager."""

    def __init__(self, store: ResponseStore, source: str):
        self.store, self.source = store, source
        self._fh = None

    def __enter__(self) -> ResponseWriter:
        self.store.dir.mkdir(parents=True, exist_ok=True)
        self.store.drop_torn_tail(self.source)
        self._fh = self.store.path(self.source).open("ab")
        return self

    def write_batch(self, rows: list[dict]) -> None:
        """Append whole rows and make them durable before returning."""
        if not rows:
            return
        payload = b"".join(
            (json.dumps({k: r.get(k) for k in RESPONSE_FIELDS}, ensure_ascii=False) + "\n").encode("utf-8")
            for r in rows
        )
        self._fh.write(payload)
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def __exit__(self, *exc) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
