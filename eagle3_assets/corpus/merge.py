"""The merged corpus of one dataset: one row per sample across sources, and its split.

Native ids win over re-tokenized ones for the same sample. Rows that failed or hold no
assistant tokens are dropped and counted. The train/eval split hashes the *prompt* id, so
every sample of a prompt lands on the same side and the split never changes as data grows; the
per-assistant-turn prompts of one conversation hash its id (the prompt table's
``conversation_id``), so they land on one side too.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import polars as pl

from eagle3_assets.prompts.turns import conversation_id

FAILED_REASONS = ("error", "abort", "cancelled")


def eval_side(prompt_id: str, eval_fraction: float, conversation: str | None = None) -> bool:
    """True when the prompt is held out: ``conversation`` (the prompt table's) hashed, or, for a
    table written before that column, the id read apart as the split did then."""
    key = conversation if conversation is not None else conversation_id(prompt_id)
    h = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")
    return h / 2**64 < eval_fraction


@dataclass
class MergeStats:
    input_rows: int = 0
    dropped_failed: int = 0
    dropped_empty: int = 0
    duplicates_resolved: int = 0
    by_source: dict = field(default_factory=dict)
    prompts_with_both_sources: int = 0
    train: int = 0
    eval: int = 0


def merge_corpus(tokens: pl.DataFrame, eval_fraction: float,
                 conversations: dict[str, str] | None = None) -> tuple[pl.DataFrame, MergeStats]:
    """``conversations``: each prompt's conversation (:func:`read_conversations`); None: read from the ids."""
    conv = conversations or {}
    stats = MergeStats(input_rows=tokens.height)
    failed = pl.col("finish_reason").is_in(FAILED_REASONS) | pl.col("finish_reason").is_null()
    stats.dropped_failed = tokens.filter(failed).height
    kept = tokens.filter(~failed)
    empty = (pl.col("completion_len") == 0) | ((pl.col("text_len") == 0) & (pl.col("completion_len") <= 1))
    stats.dropped_empty = kept.filter(empty).height
    kept = kept.filter(~empty)
    multi = kept.group_by("prompt_id").agg(pl.col("source").n_unique().alias("n"))
    stats.prompts_with_both_sources = multi.filter(pl.col("n") > 1).height
    ranked = kept.sort(["sample_id", "native_ids", "source"], descending=[False, True, False])
    merged = ranked.unique(subset="sample_id", keep="first", maintain_order=True)
    stats.duplicates_resolved = kept.height - merged.height
    merged = merged.with_columns(
        pl.col("prompt_id").map_elements(
            lambda p: "eval" if eval_side(p, eval_fraction, conv.get(p, p) if conversations is not None else None)
            else "train", return_dtype=pl.Utf8
        ).alias("split")
    ).sort(["split", "prompt_id", "sample_index"])
    stats.by_source = dict(merged.group_by("source").len().sort("source").iter_rows())
    stats.train = merged.filter(pl.col("split") == "train").height
    stats.eval = merged.height - stats.train
    return merged, stats
