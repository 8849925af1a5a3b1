"""``raw_responses``: the target model's own answers, appended to responses/<dataset>/."""


import sys
import time

import dagster as dg

from eagle3_assets.assets.prompts import prompts, read_prompt_table
from eagle3_assets.core.budget import TokenBudget
from eagle3_assets.core.local_generation import SOURCE, generate_local
from eagle3_assets.core.response_store import ResponseStore
from eagle3_assets.core.samples import SamplingSettings, plan_samples
from eagle3_assets.metadata import md_table
from eagle3_assets.partitions import datasets_partitions
from resources import DatasetSettings, EmbeddedModelResource, StorageResource


class LocalGenerationConfig(dg.Config):
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    samples_per_prompt: int = 1
    batch_size: int = 16
    max_samples: int = 0  # generate at most this many new samples in this run (0: all)


@dg.asset(
    partitions_def=datasets_partitions,
    deps=[prompts],
    group_name="generation",
    kinds={"jsonl"},
    pool="gpu",
    description="Responses of the target model (embedded backend), resumable by sample id, within the token budget.",
)
def raw_responses(
    context: dg.AssetExecutionContext,
    config: LocalGenerationConfig,
    storage: StorageResource,
    embedded_model: EmbeddedModelResource,
    dataset_settings: DatasetSettings,
) -> dg.MaterializeResult:
    dataset = context.partition_key
    layout = storage.layout
    store = ResponseStore(layout.responses_dir(dataset))
    torn = store.drop_torn_tail(SOURCE)
    if torn:
        context.log.warning(f"dropped a torn last line ({torn} bytes) left by an interrupted run")
    model = embedded_model.load()
    sampling = SamplingSettings(
        target=model.name, temperature=config.temperature, top_p=config.top_p,
        seed=config.seed, samples_per_prompt=config.samples_per_prompt,
    )
    requests = plan_samples(dataset, read_prompt_table(layout.prompt_table(dataset)), sampling)
    existing = store.rows()
    done = {r["sample_id"] for r in existing}
    if config.max_samples:
        missing = [r for r in requests if r.sample_id not in done][: config.max_samples]
        requests = [r for r in requests if r.sample_id in done] + missing
    budget = TokenBudget(dataset_settings.budget_for(dataset), used=sum(r["completion_tokens"] or 0 for r in existing))
    context.log.info(
        f"{dataset}: {len(requests)} samples planned, {len(done)} on disk; "
        f"budget {budget.limit:,} tokens, {budget.remaining:,} left"
    )
    last_log = [time.monotonic()]
    from tqdm import tqdm

    bar = tqdm(total=len(requests), initial=len([r for r in requests if r.sample_id in done]),
               desc=f"generate {dataset}", unit="sample", file=sys.stderr)

    def progress(rep, todo):
        bar.update(rep.new + rep.already_done - bar.n)
        bar.set_postfix(tok_s=f"{rep.tokens_per_s:.0f}", tokens=rep.completion_tokens)
        if time.monotonic() - last_log[0] > 10 or rep.new == todo:
            last_log[0] = time.monotonic()
            context.log.info(f"{rep.new}/{todo} new samples, {rep.completion_tokens:,} tokens, {rep.tokens_per_s:.1f} tokens/s")

    try:
        report = generate_local(
            model, requests, store, sampling, budget,
            max_new_tokens=config.max_new_tokens, batch_size=config.batch_size, progress=progress,
        )
    finally:
        bar.close()
    if report.left_by_budget:
        context.log.warning(f"{report.left_by_budget} samples not generated: the token budget is spent")
    total = store.rows()
    return dg.MaterializeResult(
        metadata={
            "new_responses": report.new,
            "total_responses": len(total),
            "skipped_already_done": report.already_done,
            "left_by_budget": report.left_by_budget,
            "new_completion_tokens": report.completion_tokens,
            "total_completion_tokens": sum(r["completion_tokens"] or 0 for r in total),
            "tokens_per_s": round(report.tokens_per_s, 2),
            "seconds": round(report.seconds, 2),
            "finish_reasons": md_table([{"finish_reason": k, "new": v} for k, v in sorted(report.finish_reasons.items())]),
            "budget_tokens": budget.limit,
            "budget_remaining": budget.remaining,
            "model": model.name,
            "sampling": sampling.as_dict(),
            "path": dg.MetadataValue.path(str(store.path(SOURCE))),
        }
    )
