"""``inventory`` (per-dataset figures in metadata.duckdb) and ``merged_corpus`` (one row per sample)."""

import dagster as dg
import polars as pl

from eagle3_assets.corpus.inventory import response_frame, summarize, tool_call_figures, write_inventory
from eagle3_assets.corpus.merge import merge_corpus
from eagle3_assets.generation.assets import raw_responses
from eagle3_assets.generation.completeness import unanswered_in_store
from eagle3_assets.generation.response_store import ResponseStore
from eagle3_assets.metadata import md_table
from eagle3_assets.partitions import datasets_partitions
from eagle3_assets.plots import length_histogram
from eagle3_assets.prompts.table import read_conversations
from eagle3_assets.resources import DatasetSettings, StorageResource
from eagle3_assets.tokens.assets import token_ids
from eagle3_assets.tokens.digest import write_digested_parquet

SHOWN = ["source", "responses", "completion_tokens", "mean_len", "p50_len", "p95_len",
         "finish_reasons", "budget_used", "budget_remaining", "cost_usd", "billed_usd", "billed_dead_runs_usd", "missing",
         "tool_call_responses", "tools_unused", "tool_call_agreement", "tool_call_exact_rate"]


@dg.asset(
    partitions_def=datasets_partitions,
    deps=[token_ids, raw_responses],
    group_name="corpus",
    kinds={"duckdb"},
    pool="duckdb",
    description="Responses, completion tokens, lengths, finish reasons, budget, dollars kept and billed, and "
                "prompts still unanswered, per dataset and source.",
)
def inventory(context: dg.AssetExecutionContext, storage: StorageResource,
              dataset_settings: DatasetSettings) -> dg.MaterializeResult:
    dataset = context.partition_key
    layout = storage.layout
    store = ResponseStore(layout.responses_dir(dataset))
    responses = store.rows()
    frame = response_frame(responses)
    missing = None
    if layout.prompt_table(dataset).exists():
        prompt_ids = pl.read_parquet(layout.prompt_table(dataset), columns=["prompt_id"])["prompt_id"].to_list()
        missing = unanswered_in_store(store, prompt_ids, responses)
    tokens_path, wanted = layout.tokens(dataset), ["source", "native_ids", "tool_calls", "retok_matched", "retok_total",
                                                   "retok_exact"]
    tokens = (pl.read_parquet(tokens_path, columns=wanted) if tokens_path.exists()
              and set(wanted) <= set(pl.read_parquet_schema(tokens_path)) else None)  # tables of older versions: none
    rows = summarize(dataset, frame, dataset_settings.budget_for(dataset), store.billing(),
                     None if missing is None else len(missing), tool_call_figures(tokens))
    write_inventory(layout.metadata_db, dataset, rows, missing)
    total = rows.filter(rows["source"] == "all").to_dicts()[0]
    lengths: dict[str, list[int]] = {}
    for r in responses:
        lengths.setdefault(r["source"], []).append(r["completion_tokens"] or 0)
    return dg.MaterializeResult(
        metadata={
            "inventory": md_table(rows.to_dicts(), SHOWN),
            "length_histogram": dg.MetadataValue.md(length_histogram(lengths, f"{dataset}: completion lengths")),
            "responses": total["responses"],
            "completion_tokens": total["completion_tokens"],
            "budget_tokens": total["budget_tokens"],
            "budget_remaining": total["budget_remaining"],
            "budget_overshoot": max(0, total["budget_used"] - total["budget_tokens"]),
            "cost_usd": float(total["cost_usd"] or 0.0),
            "billed_usd": float(total["billed_usd"] or 0.0),
            "billed_dead_runs_usd": float(total["billed_dead_runs_usd"] or 0.0),
            **({} if missing is None else {"missing": len(missing),
                                           "unanswered (first 20)": md_table(missing[:20], ["prompt_id", "reason", "detail"])}),
            "p95_len": float(total["p95_len"] or 0.0),
            "tool_call_responses": int(total["tool_call_responses"] or 0),
            "tools_unused": int(total["tools_unused"] or 0),
            "tool_call_native_rows": int(total["tool_call_native_rows"] or 0),
            "tool_call_agreement": total["tool_call_agreement"],
            "tool_call_exact_rate": total["tool_call_exact_rate"],
            "database": dg.MetadataValue.path(str(layout.metadata_db)),
        }
    )


@dg.asset(
    partitions_def=datasets_partitions,
    deps=[token_ids, inventory],
    group_name="corpus",
    kinds={"parquet"},
    description="Training sequences of one dataset, native ids preferred, failed and empty rows dropped.",
)
def merged_corpus(context: dg.AssetExecutionContext, storage: StorageResource,
                  dataset_settings: DatasetSettings) -> dg.MaterializeResult:
    dataset = context.partition_key
    layout = storage.layout
    tokens = pl.read_parquet(layout.tokens(dataset))
    corpus, stats = merge_corpus(tokens, dataset_settings.eval_fraction, read_conversations(layout.prompt_table(dataset)))
    out = layout.corpus(dataset)
    write_digested_parquet(corpus, out)  # corpus_integrity recomputes its table digest
    return dg.MaterializeResult(
        metadata={
            "rows": corpus.height,
            "train": stats.train,
            "eval": stats.eval,
            "tokens": int(corpus["input_ids"].list.len().sum() or 0),
            "loss_tokens": int(corpus["completion_len"].sum() or 0),
            "dropped_failed": stats.dropped_failed,
            "dropped_empty": stats.dropped_empty,
            "duplicates_resolved": stats.duplicates_resolved,
            "prompts_answered_by_several_sources": stats.prompts_with_both_sources,
            "by_source": stats.by_source,
            "path": dg.MetadataValue.path(str(out)),
        }
    )
