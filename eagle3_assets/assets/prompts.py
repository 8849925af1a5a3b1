"""``prompts``: a dataset's prompt file, validated and normalized to Parquet."""


import json

import dagster as dg
import polars as pl

from eagle3_assets.core.files import write_parquet_atomic
from eagle3_assets.core.prompts import read_prompt_file
from eagle3_assets.metadata import md_table
from eagle3_assets.partitions import datasets_partitions
from resources import StorageResource


class PromptsConfig(dg.Config):
    skip_invalid_rows: bool = False  # count and skip bad rows instead of failing on the first


def read_prompt_table(path) -> list:
    """Prompts back from their Parquet table as (prompt_id, messages) objects."""
    from eagle3_assets.core.prompts import Prompt

    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: materialize `prompts` for this dataset first")
    frame = pl.read_parquet(path)
    return [Prompt(r["prompt_id"], json.loads(r["messages"]), r["line"]) for r in frame.iter_rows(named=True)]


@dg.asset(
    partitions_def=datasets_partitions,
    group_name="data",
    kinds={"parquet"},
    description="Prompt rows of prompts/<dataset>.jsonl (OpenAI or ShareGPT style) with stable ids.",
)
def prompts(context: dg.AssetExecutionContext, config: PromptsConfig, storage: StorageResource) -> dg.MaterializeResult:
    dataset = context.partition_key
    layout = storage.layout
    parsed = read_prompt_file(layout.prompt_source(dataset), skip_invalid=config.skip_invalid_rows)
    frame = pl.DataFrame(
        {
            "prompt_id": [p.prompt_id for p in parsed.prompts],
            "messages": [json.dumps(p.messages, ensure_ascii=False) for p in parsed.prompts],
            "turns": [len(p.messages) for p in parsed.prompts],
            "line": [p.line for p in parsed.prompts],
        },
        schema={"prompt_id": pl.Utf8, "messages": pl.Utf8, "turns": pl.Int32, "line": pl.Int32},
    )
    out = layout.prompt_table(dataset)
    write_parquet_atomic(frame, out)
    for problem in parsed.skipped:
        context.log.warning(f"skipped: {problem}")
    preview = [
        {"prompt_id": p.prompt_id, "turns": len(p.messages), "last user turn": p.messages[-1]["content"]}
        for p in parsed.prompts[:5]
    ]
    return dg.MaterializeResult(
        metadata={
            "rows": len(parsed.prompts),
            "skipped": len(parsed.skipped),
            "skipped_rows": md_table([{"line": e.line, "field": e.field, "reason": e.reason} for e in parsed.skipped[:20]]),
            "multi_turn": sum(1 for p in parsed.prompts if len(p.messages) > 2),
            "preview": md_table(preview),
            "path": dg.MetadataValue.path(str(out)),
        }
    )
