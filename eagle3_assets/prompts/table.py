"""The prompt table ``prompts/tables/<dataset>.parquet``: its streaming writer and its reader.

The writer appends one row group per chunk to a temporary file and renames it into place only
when the whole file was good, so a failed read leaves the previous table untouched and readers
never see half a table.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_assets.prompts.rows import Prompt
from eagle3_assets.prompts.tools import tool_figures

SCHEMA = pa.schema([
    ("prompt_id", pa.string()),
    ("messages", pa.string()),  # JSON list of {"role", "content"} (+ "tool_calls", "tool_call_id"): OpenAI's shape
    ("tools", pa.string()),  # JSON list of {"type": "function", "function": {...}}; null when the prompt has none
    ("turns", pa.int32()),
    ("tool_calls", pa.int32()),  # calls made in the prompt's history
    ("tool_results", pa.int32()),  # tool-result turns
    ("line", pa.int32()),  # line (JSONL) or row (Parquet) in the prompt file
    ("prompt_tokens", pa.int32()),  # rendered with the target's chat template; null when not measured
    ("truncated", pa.bool_()),
    ("conversation_id", pa.string()),  # the conversation a per-assistant-turn prompt comes from; null: its own
])


class PromptTableWriter:
    """``with PromptTableWriter(path) as w: w.write(chunk); ...; w.commit()``; leaving the block
    without ``commit`` (an exception) discards what was written."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self._writer = pq.ParquetWriter(self.tmp, SCHEMA, compression="zstd")
        self.rows = 0

    def write(self, prompts: Iterable[Prompt]) -> None:
        prompts = list(prompts)
        if not prompts:
            return
        figures = [tool_figures(p.messages, p.tools) for p in prompts]
        batch = pa.record_batch([
            pa.array([p.prompt_id for p in prompts], pa.string()),
            pa.array([json.dumps(p.messages, ensure_ascii=False) for p in prompts], pa.string()),
            pa.array([json.dumps(p.tools, ensure_ascii=False) if p.tools else None for p in prompts], pa.string()),
            pa.array([len(p.messages) for p in prompts], pa.int32()),
            pa.array([f["tool_calls"] for f in figures], pa.int32()),
            pa.array([f["tool_results"] for f in figures], pa.int32()),
            pa.array([p.line for p in prompts], pa.int32()),
            pa.array([p.prompt_tokens for p in prompts], pa.int32()),
            pa.array([p.truncated for p in prompts], pa.bool_()),
            pa.array([p.conversation_id for p in prompts], pa.string()),
        ], schema=SCHEMA)
        self._writer.write_batch(batch)
        self.rows += len(prompts)

    def commit(self) -> int:
        """Close and move into place; returns bytes written."""
        self._writer.close()
        os.replace(self.tmp, self.path)
        return self.path.stat().st_size

    def abort(self) -> None:
        self._writer.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> PromptTableWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.tmp.exists():
            self.abort()


def write_prompt_table(prompts: list[Prompt], path: Path) -> int:
    """Write a list of prompts at once; returns bytes written."""
    with PromptTableWriter(path) as writer:
        writer.write(prompts)
        return writer.commit()


def read_prompt_table(path) -> list[Prompt]:
    """Prompts back from their Parquet table."""
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: materialize `prompts` for this dataset first")
    frame = pl.read_parquet(path)
    has_tokens = "prompt_tokens" in frame.columns
    return [
        Prompt(r["prompt_id"], json.loads(r["messages"]), r["line"],
               tools=json.loads(r["tools"]) if r.get("tools") else None,
               prompt_tokens=r["prompt_tokens"] if has_tokens else None, truncated=bool(r.get("truncated")),
               conversation_id=r.get("conversation_id"))
        for r in frame.iter_rows(named=True)
    ]


def read_conversations(path: Path) -> dict[str, str] | None:
    """Each prompt's conversation (its own id when it is one), for the train/eval split; None for a
    table written before the ``conversation_id`` column (the split then reads the ids apart)."""
    if not Path(path).exists() or "conversation_id" not in pq.read_schema(path).names:
        return None
    frame = pl.read_parquet(path, columns=["prompt_id", "conversation_id"])
    return dict(zip(frame["prompt_id"], frame["conversation_id"].fill_null(frame["prompt_id"]), strict=True))
