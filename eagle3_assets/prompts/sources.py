"""The records of a prompt file, streamed: JSONL, gzip-compressed JSONL and Parquet.

Nothing here holds more than one line (JSONL) or one record batch (Parquet) at a time, so a
10 GB file is read in constant memory. Each record comes with its position (1-based line or
row) and either the row as a dict or the reason it is not one. Problems with the file as a whole
(not gzip, not Parquet, a mapped column missing) raise :class:`PromptFileError` at once.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from eagle3_assets.paths import PROMPT_SUFFIXES, prompt_file_suffix
from eagle3_assets.prompts.options import ColumnMap
from eagle3_assets.prompts.problems import PromptFileError, RowError

BOM = "\ufeff"
UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
PARQUET_BATCH_ROWS = 1024
JSON_NOT_JSONL = " (a JSON array or indented JSON? JSONL holds one object per line)"


@dataclass
class Record:
    number: int
    row: dict | None
    error: RowError | None = None


class PromptSource:
    """One prompt file; ``unit`` is what its positions count ("line" or "row")."""

    def __init__(self, path: Path | str, columns: ColumnMap | None = None):
        self.path = Path(path)
        self.columns = columns or ColumnMap()
        self.suffix = prompt_file_suffix(self.path)
        if not self.path.is_file():
            raise PromptFileError(f"prompt file {self.path} does not exist")
        if self.suffix is None:
            raise PromptFileError(f"{self.path}: prompt files end in {', '.join(PROMPT_SUFFIXES)}")
        self.unit = "row" if self.suffix == ".parquet" else "line"

    def records(self) -> Iterator[Record]:
        if self.suffix == ".parquet":
            yield from self._parquet()
        else:
            yield from self._jsonl()

    # JSONL and JSONL.gz ------------------------------------------------------------------

    def _jsonl(self) -> Iterator[Record]:
        gz = self.suffix == ".jsonl.gz"
        line_no = 0
        try:
            with (gzip.open(self.path, "rb") if gz else self.path.open("rb")) as fh:
                for line_no, raw in enumerate(fh, start=1):
                    if line_no == 1 and raw.startswith(UTF16_BOMS):
                        raise PromptFileError(f"{self.path}: the file is UTF-16; save it as UTF-8 (one JSON object a line)")
                    record = self._jsonl_record(line_no, raw)
                    if record is not None:
                        yield record
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:  # only gzip raises these here
            raise PromptFileError(f"{self.path}: not a complete gzip file (after line {line_no}: {e})") from None

    @staticmethod
    def _jsonl_record(line_no: int, raw: bytes) -> Record | None:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return Record(line_no, None, RowError("(line)", f"not UTF-8 ({e.reason} at byte {e.start})", "not UTF-8"))
        text = text.lstrip(BOM)  # a byte-order mark opens the file, or a file concatenated into it
        if not text.strip():
            return None
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            hint = JSON_NOT_JSONL if text.strip() in ("[", "{") else ""
            return Record(line_no, None, RowError("(line)", f"not valid JSON: {e.msg} at column {e.colno}{hint}",
                                                  "not valid JSON"))
        if not isinstance(row, dict):
            hint = JSON_NOT_JSONL if isinstance(row, list) else ""
            return Record(line_no, None, RowError("(line)", f"must be a JSON object, got {type(row).__name__}{hint}",
                                                  "not a JSON object"))
        return Record(line_no, row)

    # Parquet -------------------------------------------------------------------------------

    def _parquet(self) -> Iterator[Record]:
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(self.path)
        except Exception as e:  # pyarrow raises ArrowInvalid/OSError for anything not Parquet
            raise PromptFileError(f"{self.path}: not a readable Parquet file ({e})") from None
        names = list(pf.schema_arrow.names)
        wanted = self._parquet_columns(names)
        number = 0
        try:
            for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=wanted):
                for row in batch.to_pylist():
                    number += 1
                    yield Record(number, row)
        except PromptFileError:
            raise
        except Exception as e:  # a corrupt page part-way through
            raise PromptFileError(f"{self.path}: unreadable after row {number} ({e})") from None

    def _parquet_columns(self, names: list[str]) -> list[str]:
        """The columns to read; refuses a map that names a column the file lacks."""
        cols = self.columns
        shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
        named = [*cols.user, *([cols.system] if cols.system else []), *([cols.chat] if cols.chat else [])]
        missing = [c for c in named if c not in names]
        if missing:
            raise PromptFileError(f"{self.path}: no column {', '.join(map(repr, missing))} (the column map names it); "
                                  f"the file has: {shown}")
        glaive = cols.chat or "chat" in names
        if not cols.user and cols.messages not in names and cols.conversations not in names and not glaive:
            raise PromptFileError(
                f"{self.path}: neither a {cols.messages!r} (OpenAI style) nor a {cols.conversations!r} (ShareGPT) "
                f"nor a 'chat' (glaive) column; the file has: {shown}. Name the prompt columns with --map (see docs/datasets.md)")
        used = [cols.id, *named, cols.tools] + ([] if cols.user else [cols.messages, cols.conversations])
        if glaive:
            used += [cols.chat or "chat", cols.system or "system"]
        return [c for c in dict.fromkeys(used) if c in names]
