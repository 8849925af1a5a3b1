"""``prompts``: a dataset's prompt file, validated and normalized to Parquet."""

import dagster as dg

from eagle3_assets.metadata import md_table
from eagle3_assets.partitions import datasets_partitions
from eagle3_assets.prompts.reader import read_prompt_file
from eagle3_assets.prompts.table import write_prompt_table
from resources import StorageResource


class PromptsConfig(dg.Config):
    skip_invalid_rows: bool = False  # count and skip bad rows instead of failing on the first


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
    out = layout.prompt_table(dataset)
    write_prompt_table(parsed.prompts, out)
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
