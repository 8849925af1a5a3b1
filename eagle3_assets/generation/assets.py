"""``raw_responses``: the target model's own answers, appended to responses/<dataset>/<source>.jsonl.

Four backends behind one asset: the embedded model in-process (``local``), SGLang servers
(``sglang``, exact ids), OpenRouter (``openrouter``, text) and any OpenAI-compatible server that
returns token ids, such as vLLM (``vllm``, exact ids). Every backend resumes by sample
id across all sources on disk, so a dataset can start on one and finish on another.
"""

import math
import sys
import time

import dagster as dg

from eagle3_assets.generation.budget import TokenBudget
from eagle3_assets.generation.response_store import ResponseStore
from eagle3_assets.generation.samples import SamplingSettings, plan_samples
from eagle3_assets.metadata import md_table
from eagle3_assets.partitions import datasets_partitions
from eagle3_assets.prompts.assets import prompts
from eagle3_assets.prompts.table import read_prompt_table
from resources import DatasetSettings, OpenRouterResource, SGLangResource, StorageResource, TargetResource, VLLMResource

BACKENDS = ("local", "sglang", "openrouter", "vllm")


class GenerationConfig(dg.Config):
    backend: str = "local"  # "local" (embedded model), "sglang", "openrouter" or "vllm" (OpenAI API + token ids)
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    samples_per_prompt: int = 1
    batch_size: int = 16  # local backend
    concurrency: int = 256  # HTTP backends: requests in flight
    max_samples: int = 0  # generate at most this many new samples in this run (0: all)


class _Progress:
    """A terminal bar plus a Dagster log line every few seconds."""

    def __init__(self, context, dataset: str, total: int, done: int):
        from tqdm import tqdm

        self.context, self.last = context, time.monotonic()
        self.bar = tqdm(total=total, initial=done, desc=f"generate {dataset}", unit="sample", file=sys.stderr)

    def local(self, rep, todo):
        self.bar.update(rep.new + rep.already_done - self.bar.n)
        self.bar.set_postfix(tok_s=f"{rep.tokens_per_s:.0f}", tokens=rep.completion_tokens)
        if time.monotonic() - self.last > 10 or rep.new == todo:
            self.last = time.monotonic()
            self.context.log.info(f"{rep.new}/{todo} new samples, {rep.completion_tokens:,} tokens, "
                                  f"{rep.tokens_per_s:.1f} tokens/s")

    def http(self, p):
        self.context.log.info(p.line())

    def close(self):
        self.bar.close()


def _run_local(context, config, model, requests, store, budget, sampling, progress):
    from eagle3_assets.generation.local import generate_local

    rep = generate_local(model, requests, store, sampling, budget, max_new_tokens=config.max_new_tokens,
                         batch_size=config.batch_size, progress=progress.local)
    return {
        "new_responses": rep.new, "new_completion_tokens": rep.completion_tokens, "left_by_budget": rep.left_by_budget,
        "tokens_per_s": round(rep.tokens_per_s, 2), "seconds": round(rep.seconds, 2), "cost_usd_new": 0.0,
        "finish_reasons": md_table([{"finish_reason": k, "new": v} for k, v in sorted(rep.finish_reasons.items())]),
    }


def _run_http(context, config, backend, client_cfg, requests, store, budget, sampling, progress):
    from eagle3_assets.generation.http_engine import generate_http, plan_remaining, raise_for_stop

    prices = getattr(backend, "prices", None)
    plan = plan_remaining(requests, store, budget.limit, max_tokens=config.max_new_tokens, prices=prices)
    cost = "n/a (no prices configured)" if plan.projected_cost_usd is None else f"${plan.projected_cost_usd:,.2f} (ESTIMATE)"
    context.log.info(f"to do: {plan.todo} samples; budget left {plan.budget_remaining:,} tokens "
                     f"(room for {plan.fits_worst_case} at max_tokens); projected cost {cost}")
    rep = generate_http(requests, backend, store, budget, sampling=sampling, max_tokens=config.max_new_tokens,
                        concurrency=config.concurrency, progress=progress.http, bar=True, client=client_cfg,
                        max_new_samples=config.max_samples or None)
    raise_for_stop(rep)
    s = rep.summary()
    return {
        "new_responses": rep.new, "new_completion_tokens": rep.completion_tokens, "left_by_budget": rep.left_by_budget,
        "tokens_per_s": round(rep.tokens_per_s, 2), "seconds": round(rep.elapsed_s, 2),
        "cost_usd_new": rep.cost_usd, "errors": rep.errors, "retries": dict(rep.retries),
        "achieved_concurrency": s.get("achieved_concurrency"),
        "finish_reasons": md_table([{"finish_reason": k, "new": v} for k, v in sorted(rep.finish_reasons.items())]),
        "plan_before_run (estimate)": {k: v for k, v in plan.summary().items() if not isinstance(v, dict)},
    }


@dg.asset(
    partitions_def=datasets_partitions,
    deps=[prompts],
    group_name="generation",
    kinds={"jsonl"},
    pool="gpu",
    description="Responses of the target model, resumable by sample id across sources, within the token budget.",
)
def raw_responses(
    context: dg.AssetExecutionContext,
    config: GenerationConfig,
    storage: StorageResource,
    target: TargetResource,
    sglang: SGLangResource,
    openrouter: OpenRouterResource,
    vllm: VLLMResource,
    dataset_settings: DatasetSettings,
) -> dg.MaterializeResult:
    if config.backend not in BACKENDS:
        raise ValueError(f"unknown backend {config.backend!r}; expected one of {BACKENDS}")
    dataset = context.partition_key
    layout = storage.layout
    store = ResponseStore(layout.responses_dir(dataset))
    torn = store.drop_torn_tail(config.backend)
    if torn:
        context.log.warning(f"dropped a torn last line ({torn} bytes) left by an interrupted run")
    spec = target.spec()
    model = target.load_model() if config.backend == "local" else None
    tok = target.load_tokenizer()
    sampling = SamplingSettings(target=spec.name, temperature=config.temperature, top_p=config.top_p,
                                seed=config.seed, samples_per_prompt=config.samples_per_prompt)
    requests = plan_samples(dataset, read_prompt_table(layout.prompt_table(dataset)), sampling)
    existing = store.rows()
    done = {r["sample_id"] for r in existing}
    if config.max_samples:
        missing = [r for r in requests if r.sample_id not in done][: config.max_samples]
        requests = [r for r in requests if r.sample_id in done] + missing
    budget = TokenBudget(dataset_settings.budget_for(dataset), used=sum(r["completion_tokens"] or 0 for r in existing))
    context.log.info(f"{dataset}: {len(requests)} samples planned, {len(done)} on disk (all sources); "
                     f"budget {budget.limit:,} tokens, {budget.remaining:,} left; backend {config.backend}")
    progress = _Progress(context, dataset, len(requests), sum(1 for r in requests if r.sample_id in done))
    try:
        if config.backend == "local":
            figures = _run_local(context, config, model, requests, store, budget, sampling, progress)
        elif config.backend == "sglang":
            figures = _run_http(context, config, sglang.backend(tok.render_prompt), sglang.client_config(),
                                requests, store, budget, sampling, progress)
        elif config.backend == "vllm":
            figures = _run_http(context, config, vllm.backend(tok.render_prompt, spec.served_name), vllm.client_config(),
                                requests, store, budget, sampling, progress)
        else:
            figures = _run_http(context, config, openrouter.backend(spec.served_name), openrouter.client_config(),
                                requests, store, budget, sampling, progress)
    finally:
        progress.close()
    if figures["left_by_budget"]:
        context.log.warning(f"{figures['left_by_budget']} samples not generated: the token budget is spent")
    total = store.rows()
    return dg.MaterializeResult(
        metadata={
            **figures,
            "backend": config.backend,
            "total_responses": len(total),
            "skipped_already_done": len(done & {r.sample_id for r in requests}),
            "total_completion_tokens": sum(r["completion_tokens"] or 0 for r in total),
            "total_cost_usd": math.fsum(r.get("cost_usd") or 0.0 for r in total),
            "budget_tokens": budget.limit,
            "budget_remaining": budget.limit - sum(r["completion_tokens"] or 0 for r in total),
            "target": spec.name,
            "sampling": sampling.as_dict(),
            "path": dg.MetadataValue.path(str(store.dir)),
        }
    )
