"""``merged_corpus``: one row per sample across sources, with a deterministic split."""


import dagster as dg
import polars as pl

from eagle3_assets.assets.inventory import inventory
from eagle3_assets.assets.tokens import token_ids
from eagle3_assets.core.corpus import merge_corpus
from eagle3_assets.core.files import write_parquet_atomic
from eagle3_assets.partitions import datasets_partitions
from resources import DatasetSettings, StorageResource


@dg.asset(
    partitions_def=datasets_partitions,
    deps=[token_ids, inventory],
    group_name="data",
    kinds={"parquet"},
    description="Training sequences of one dataset, native ids preferred, failed and empty rows dropped.",
)
def merged_corpus(context: dg.AssetExecutionContext, storage: StorageResource, dataset_settings: DatasetSettings) -> dg.MaterializeResult:
    dataset = context.partition_key
    layout = storage.layout
    tokens = pl.read_parquet(layout.tokens(dataset))
    corpus, stats = merge_corpus(tokens, dataset_settings.eval_fraction)
    out = layout.corpus(dataset)
    write_parquet_atomic(corpus, out)
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
