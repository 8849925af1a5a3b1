"""``prompts``: a dataset's prompt file, validated, measured against the target and normalized to Parquet."""

import json
import time
from typing import Literal

import dagster as dg
import polars as pl

from eagle3_assets.errors import UserInputError
from eagle3_assets.metadata import md_table
from eagle3_assets.partitions import datasets_partitions
from eagle3_assets.prompts.build import BuildReport, build_prompt_table
from eagle3_assets.prompts.context import ContextLimit
from eagle3_assets.prompts.options import ReadOptions
from eagle3_assets.prompts.problems import PromptFileError
from eagle3_assets.prompts.reader import PromptReader
from eagle3_assets.prompts.turns import prompts_per_conversation_rows
from eagle3_assets.resources import DatasetSettings, StorageResource, TargetResource


class PromptsConfig(dg.Config):
    skip_invalid_rows: bool = False  # skip and count bad rows instead of refusing the file
    # a prompt whose rendered length + dataset_settings' context reserve exceeds the target's context:
    # "refuse" (a bad row), "skip" it, or "truncate" its last user turn in the middle
    over_context: Literal["refuse", "skip", "truncate"] = "refuse"
    # a target whose chat template renders no tools: write a row's tools into its system turn instead
    # of refusing the row (also `tools_in_system_turn` in the dataset's .read.json)
    tools_in_system_turn: bool = False


class _Progress:
    def __init__(self, context, every_s: float = 10.0):
        self.context, self.every_s, self.last = context, every_s, time.monotonic()

    def __call__(self, report: BuildReport) -> None:
        if time.monotonic() - self.last >= self.every_s:
            self.last = time.monotonic()
            self.context.log.info(f"read {report.rows:,} rows, measured {len(report.lengths):,} prompts")


def _failure(e: UserInputError) -> dg.Failure:
    """The summary as the step's failure message; counts per kind as its metadata."""
    meta = {}
    if isinstance(e, PromptFileError) and e.log:
        meta = {"bad_rows": e.log.total, "rows_read": e.rows, "by_kind": md_table(
            [{"kind": k, "rows": n} for k, n in e.log.counts.most_common()]), "first_bad_rows": md_table(e.log.as_rows())}
    return dg.Failure(description=str(e), metadata=meta, allow_retries=False)


@dg.asset(
    partitions_def=datasets_partitions,
    group_name="prompts",
    kinds={"parquet"},
    description="Prompt rows of prompts/<dataset>.{jsonl,jsonl.gz,parquet} (OpenAI, ShareGPT or glaive style, tools "
                "included, or mapped columns) with stable ids and their length with the target's chat template.",
)
def prompts(context: dg.AssetExecutionContext, config: PromptsConfig, storage: StorageResource,
            target: TargetResource, dataset_settings: DatasetSettings) -> dg.MaterializeResult:
    dataset = context.partition_key
    layout = storage.layout
    out = layout.prompt_table(dataset)
    try:
        if not layout.prompt_sources(dataset):
            raise UserInputError(f"no prompt file for dataset {dataset!r} in {layout.prompts_dir} "
                                 f"({dataset}.jsonl, {dataset}.jsonl.gz or {dataset}.parquet)")
        options = ReadOptions.load(layout.prompt_read_options(dataset))
        reader = PromptReader(layout.prompt_source(dataset), options,
                              skip_invalid=config.skip_invalid_rows or options.skip_invalid_rows)
        tok = target.load_tokenizer()
        limit = ContextLimit(tok.context_length, dataset_settings.context_reserve_for(dataset))
        if limit.max_prompt_tokens is not None and limit.max_prompt_tokens <= 0:
            raise UserInputError(f"dataset_settings reserves {limit.reserve:,} reply tokens for {dataset!r}, "
                                 f"all of the target's context of {limit.context_length:,}")
        context.log.info(f"{reader.path}: reading; target context {limit.context_length or 'unknown'}, "
                         f"{limit.reserve:,} tokens reserved for the reply, over_context: {config.over_context}")
        report = build_prompt_table(reader, tok, limit, config.over_context, out, progress=_Progress(context),
                                    tools_in_system_turn=config.tools_in_system_turn or options.tools_in_system_turn)
    except UserInputError as e:
        raise _failure(e) from None
    if reader.skipped:
        context.log.warning("skipped bad rows:\n" + reader.log.summary(reader.rows, hint=""))
    if report.over_context:
        context.log.warning(f"{report.over_context:,} prompts over the context: {report.truncated:,} truncated, "
                            f"{report.skipped_over_context:,} skipped")
    lengths = report.length_figures()
    preview = [{"prompt_id": r["prompt_id"], "turns": r["turns"], "prompt_tokens": r["prompt_tokens"],
                "last turn": json.loads(r["messages"])[-1]["content"]}
               for r in pl.scan_parquet(out).head(5).collect().iter_rows(named=True)]
    return dg.MaterializeResult(
        metadata={
            "rows": report.written,
            "rows_read": report.rows,
            "skipped": reader.skipped,
            "skipped_rows": md_table(reader.log.as_rows()),
            "final_assistant_dropped": reader.final_assistant_dropped,
            "conversations": reader.conversations,
            "prompts_per_conversation": md_table(prompts_per_conversation_rows(reader.prompts_per_conversation)),
            "prompts_per_conversation_mean": round(reader.accepted / reader.conversations, 3) if reader.conversations else 0,
            "prompt_tokens_p50": lengths.get("p50", 0),
            "prompt_tokens_p95": lengths.get("p95", 0),
            "prompt_tokens_max": lengths.get("max", 0),
            "context_length": limit.context_length or 0,
            "context_reserve": limit.reserve,
            "over_context": report.over_context,
            "truncated": report.truncated,
            "skipped_over_context": report.skipped_over_context,
            "over_context_rows": md_table(report.over_examples),
            **report.tool_figures(),
            "source": dg.MetadataValue.path(str(reader.path)),
            "seconds": round(report.seconds, 2),
            "preview": md_table(preview),
            "path": dg.MetadataValue.path(str(out)),
        }
    )
