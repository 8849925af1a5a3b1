"""The prompt table ``prompts/<dataset>.parquet``: its writer and reader."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl

from eagle3_assets.files import write_parquet_atomic
from eagle3_assets.prompts.reader import Prompt

SCHEMA = {"prompt_id": pl.Utf8, "messages": pl.Utf8, "turns": pl.Int32, "line": pl.Int32}


def write_prompt_table(prompts: list[Prompt], path: Path) -> int:
    """Write the prompts atomically; returns bytes written."""
    frame = pl.DataFrame(
        {
            "prompt_id": [p.prompt_id for p in prompts],
            "messages": [json.dumps(p.messages, ensure_ascii=False) for p in prompts],
            "turns": [len(p.messages) for p in prompts],
            "line": [p.line for p in prompts],
        },
        schema=SCHEMA,
    )
    return write_parquet_atomic(frame, path)


def read_prompt_table(path) -> list:
    """Prompts back from their Parquet table as (prompt_id, messages) objects."""
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: materialize `prompts` for this dataset first")
    frame = pl.read_parquet(path)
    return [Prompt(r["prompt_id"], json.loads(r["messages"]), r["line"]) for r in frame.iter_rows(named=True)]
