"""The token table ``tokens/<dataset>.parquet``: schema, writer and agreement figures."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from eagle3_assets.tokens.digest import DIGEST_COLUMN, RESPONSE_DIGEST_COLUMN, row_digest, write_digested_parquet

TOKEN_SCHEMA = {
    "sample_id": pl.Utf8, "dataset": pl.Utf8, "prompt_id": pl.Utf8, "sample_index": pl.Int32,
    "source": pl.Utf8, "model": pl.Utf8, "finish_reason": pl.Utf8,
    "input_ids": pl.List(pl.Int32), "loss_mask": pl.List(pl.Int8),
    "prompt_len": pl.Int32, "completion_len": pl.Int32, "text_len": pl.Int32, "literal_specials": pl.Int32,
    "has_tools": pl.Boolean, "tool_calls": pl.Int32,  # the prompt declared tools; calls in the reply
    "native_ids": pl.Boolean, "built_from": pl.Utf8, "build_notes": pl.Utf8,
    "retok_matched": pl.Int32, "retok_total": pl.Int32, "retok_exact": pl.Boolean, "retok_diff": pl.Utf8,
    DIGEST_COLUMN: pl.Utf8,  # of input_ids + loss_mask, written here: ``token_rows_intact`` recomputes it
    RESPONSE_DIGEST_COLUMN: pl.Utf8,  # of the reply line the row was built from (``token_ids`` sets it)
}


def agreement_summary(frame: pl.DataFrame) -> dict:
    """Token-level agreement and exact-sequence rate over rows that have native ids, and the same
    for the tool-call replies among them (rebuilt by the chat template, not by encoding text)."""
    native = frame.filter(pl.col("native_ids"))
    calls = native.filter(pl.col("tool_calls") > 0) if "tool_calls" in native.columns else native.clear()

    def figures(part: pl.DataFrame) -> tuple[float | None, float | None]:
        total, matched = int(part["retok_total"].sum() or 0), int(part["retok_matched"].sum() or 0)
        return (matched / total if total else None), (float(part["retok_exact"].mean()) if part.height else None)

    agreement, exact = figures(native)
    tool_agreement, tool_exact = figures(calls)
    return {
        "rows_with_native_ids": native.height,
        "token_agreement": agreement,
        "exact_sequence_rate": exact,
        "tool_call_rows_with_native_ids": calls.height,
        "tool_call_token_agreement": tool_agreement,
        "tool_call_exact_rate": tool_exact,
    }


def write_token_table(rows: list[dict], path: Path) -> pl.DataFrame:
    """Write token rows atomically, each with the digest of its ids and mask, the file with its table
    digest (``tokens/digest.py``); returns the frame written."""
    rows = [{**r, DIGEST_COLUMN: row_digest(r["input_ids"], r["loss_mask"])} for r in rows]
    frame = pl.DataFrame(rows, schema=TOKEN_SCHEMA) if rows else pl.DataFrame(schema=TOKEN_SCHEMA)
    write_digested_parquet(frame, path)
    return frame
