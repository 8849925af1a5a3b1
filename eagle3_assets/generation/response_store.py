"""The append-only response files of one dataset: ``responses/<dataset>/<source>.jsonl``.

One writer per file appends whole lines with one ``write`` system call each, so a killed process
loses nothing the operating system already has and a crash can only leave a torn last line, which
is detected and cut off before the next append. ``fsync`` runs per batch (``write_batch``) or on
the caller's schedule (``sync``), which bounds what a machine crash can lose. Resume asks which
sample ids are already present in *any* source; nothing here counts lines.

Beside the sources live ``errors.jsonl`` (samples that failed, with their reason),
``billing.jsonl`` (dollars billed for attempts that left no row: failed or lost replies, and the
share of runs that died) and ``key_usage.jsonl`` (the key's usage around every run, see
:mod:`~eagle3_assets.generation.key_ledger`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

# The response row contract (docs/datasets.md, "The data stages"); writers fill every key.
RESPONSE_FIELDS = (
    "sample_id", "dataset", "prompt_id", "sample_index", "source", "model", "provider",
    "prompt_ids", "output_ids", "text", "reasoning", "tool_calls", "finish_reason",
    "prompt_tokens", "completion_tokens", "reasoning_tokens", "cost_usd", "latency_s", "attempts", "created_at",
    "native_finish_reason", "generation_id", "flags",
)


# Files in a dataset's response directory that hold no response rows.
NOT_SOURCES = ("errors.jsonl", "billing.jsonl", "key_usage.jsonl")


class CorruptResponseFile(ValueError):
    """A complete line in a response file that is not a valid row."""


def complete_length(path: Path) -> int:
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

    @property
    def billing_path(self) -> Path:
        return self.dir / "billing.jsonl"

    def source_files(self) -> list[Path]:
        if not self.dir.is_dir():
            return []
        return sorted(p for p in self.dir.glob("*.jsonl") if p.name not in NOT_SOURCES)

    def torn_bytes(self, source: str) -> int:
        p = self.path(source)
        return p.stat().st_size - complete_length(p) if p.exists() else 0

    def drop_torn_tail(self, source: str) -> int:
        """Cut an incomplete last line left by a crash; returns the bytes removed."""
        p = self.path(source)
        if not p.exists():
            return 0
        keep = complete_length(p)
        torn = p.stat().st_size - keep
        if torn:
            with p.open("r+b") as fh:
                fh.truncate(keep)
                fh.flush()
                os.fsync(fh.fileno())
        return torn

    def iter_lines(self, sources: Iterable[str] | None = None) -> Iterator[tuple[Path, int, bytes]]:
        """(file, line number, line) of every complete, non-blank line of the given sources."""
        files = [self.path(s) for s in sources] if sources else self.source_files()
        for p in files:
            if not p.exists():
                continue
            keep = complete_length(p)
            with p.open("rb") as fh:
                data = fh.read(keep)
            for line_no, raw in enumerate(data.splitlines(), start=1):
                if raw.strip():
                    yield p, line_no, raw

    def iter_rows_with_lines(self, sources: Iterable[str] | None = None) -> Iterator[tuple[dict, bytes]]:
        """Each complete row with the line it was read from (what a row built from it digests)."""
        for p, line_no, raw in self.iter_lines(sources):
            try:
                row = json.loads(raw)
            except json.JSONDecodeError as e:
                raise CorruptResponseFile(f"{p}, line {line_no}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or "sample_id" not in row:
                raise CorruptResponseFile(f"{p}, line {line_no}, field 'sample_id': missing")
            yield row, raw

    def iter_rows(self, sources: Iterable[str] | None = None) -> Iterator[dict]:
        """Complete rows of the given sources (all by default); a torn last line is ignored."""
        for row, _ in self.iter_rows_with_lines(sources):
            yield row

    def rows(self, sources: Iterable[str] | None = None) -> list[dict]:
        return list(self.iter_rows(sources))

    def finished_ids(self) -> set[str]:
        return {r["sample_id"] for r in self.iter_rows()}

    def writer(self, source: str) -> ResponseWriter:
        return ResponseWriter(self, source)

    def append_error(self, record: dict) -> None:
        with JsonlAppender(self.errors_path) as out:
            out.append(record)
            out.sync()

    @property
    def last_run_path(self) -> Path:
        return self.dir / "last_run.json"

    def write_last_run(self, summary: dict) -> None:
        """The dataset's last ``raw_responses`` figures (why samples are missing, among others)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.last_run_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(summary, ensure_ascii=False, default=str, indent=1))
        os.replace(tmp, self.last_run_path)

    def last_run(self) -> dict | None:
        try:
            return json.loads(self.last_run_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def errors(self) -> list[dict]:
        return list(iter_jsonl(self.errors_path))

    def billing(self) -> list[dict]:
        return list(iter_jsonl(self.billing_path))


def iter_jsonl(path: Path) -> Iterator[dict]:
    """Complete JSON lines of a side file (errors, billing); a torn last line is ignored."""
    if not path.exists():
        return
    with path.open("rb") as fh:
        data = fh.read(complete_length(path))
    for line_no, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            yield json.loads(raw)
        except json.JSONDecodeError as e:
            raise CorruptResponseFile(f"{path}, line {line_no}: not valid JSON ({e.msg})") from None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class _AppendOnlyFile:
    """An ``O_APPEND`` descriptor: whole lines reach the OS at once, ``sync`` makes them durable."""

    _fd: int | None = None
    dirty: bool = False

    def sync(self) -> None:
        if self.dirty and self._fd is not None:
            self.dirty = False
            os.fsync(self._fd)

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            try:
                self.sync()
            finally:
                os.close(self._fd)
                self._fd = None


class JsonlAppender(_AppendOnlyFile):
    """Appends whole JSON lines to one file, each with a single ``write`` (O_APPEND). The file is
    created by the first record, so a run without errors leaves no empty errors file."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def __enter__(self) -> JsonlAppender:
        return self

    def _open(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():  # a torn last line from a crash: cut it before appending
            keep = complete_length(self.path)
            if keep != self.path.stat().st_size:
                os.truncate(self.path, keep)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        return self._fd

    def append(self, record: dict) -> None:
        fd = self._fd if self._fd is not None else self._open()
        _write_all(fd, (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        self.dirty = True


def encode_row(row: dict) -> bytes:
    return (json.dumps({k: row.get(k) for k in RESPONSE_FIELDS}, ensure_ascii=False) + "\n").encode("utf-8")


class ResponseWriter(_AppendOnlyFile):
    """The single writer of one source file; use as a context manager.

    ``write_row`` hands one row to the operating system at once (a killed process cannot lose it);
    ``sync`` makes what was written durable against a machine crash; ``write_batch`` does both.
    """

    def __init__(self, store: ResponseStore, source: str):
        self.store, self.source = store, source

    def __enter__(self) -> ResponseWriter:
        self.store.dir.mkdir(parents=True, exist_ok=True)
        self.store.drop_torn_tail(self.source)
        self._fd = os.open(self.store.path(self.source), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        return self

    def write_row(self, row: dict) -> None:
        _write_all(self._fd, encode_row(row))
        self.dirty = True

    def write_batch(self, rows: list[dict]) -> None:
        """Append whole rows and make them durable before returning."""
        if not rows:
            return
        _write_all(self._fd, b"".join(encode_row(r) for r in rows))
        self.dirty = True
        self.sync()


