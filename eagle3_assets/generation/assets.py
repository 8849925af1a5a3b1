"""``raw_responses``: the target model's own answers, appended to responses/<dataset>/<source>.jsonl.

Every engine serving the generate role (``eagle3_assets.engines.ROLES``) behind one asset: the
embedded model in-process (``local``), SGLang servers (``sglang``, exact ids), OpenRouter
(``openrouter``, text) and any OpenAI-compatible server that returns token ids, such as vLLM
(``vllm``, exact ids); the asset asks the registry for the configured one and names none. Every
backend resumes by sample id across all sources on disk, so a dataset can start on one and finish
on another.

A backfill runs every selected dataset in one step (``BackfillPolicy.single_run``): the HTTP
backends then serve all of them through one in-flight gate, each dataset with its own budget,
files and materialization. Local, SGLang and vLLM generation hold the ``gpu`` pool while they run; API
generation never waits for it.
"""

import sys
import time
import warnings
from contextlib import nullcontext
from typing import Literal

import dagster as dg

from eagle3_assets.engines import engine_names, engine_resources, engine_role
from eagle3_assets.engines.http.samples import SamplingSettings
from eagle3_assets.engines.http.tool_flags import TOOLS_SENT, TOOLS_UNUSED, unused_tools_line
from eagle3_assets.errors import UserInputError
from eagle3_assets.generation.admission import POLICIES, AdmissionPolicy
from eagle3_assets.generation.dataset_run import PreparedDataset, missing_line, prepare_dataset, summarize
from eagle3_assets.metadata import md_table
from eagle3_assets.partitions import datasets_partitions
from eagle3_assets.prompts.assets import prompts
from eagle3_assets.runs import pool_slot

BACKENDS = engine_names("generate")  # the engines serving generate: the config's typed choice is built from it
Backend = Literal[BACKENDS]  # a name outside BACKENDS is refused by the config schema, naming them
SLOW_LOOP_MS = 100.0  # a client loop later than this at p99 is warned about

# `backfill_policy` is marked beta; and a job holding this asset with the one-dataset-per-run stages
# (`dataset_pipeline`) warns that it backfills one partition per run, which is what it is for.
warnings.filterwarnings("ignore", category=dg.BetaWarning, message=".*Parameter `backfill_policy`")
warnings.filterwarnings("ignore", category=UserWarning, message=".*materializes assets with varying BackfillPolicies")


class GenerationConfig(dg.Config):
    backend: Backend = "local"  # an engine serving generate: "local" (embedded model), "sglang", "openrouter" or "vllm"
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    samples_per_prompt: int = 1
    batch_size: int = 16  # local backend
    concurrency: int = 0  # HTTP: requests in flight for the whole run, all datasets together (0: the resource's)
    budget_policy: str = "expected"  # "expected" (learned reply lengths, keeps the gate full) or "strict"
    budget_policies: dict[str, str] = {}  # per dataset, overriding budget_policy
    max_samples: int = 0  # per dataset: generate at most this many new samples in this run (0: all)


def _validate(config: GenerationConfig) -> None:
    for where, kind in [("budget_policy", config.budget_policy), *config.budget_policies.items()]:
        if kind not in POLICIES:
            raise dg.Failure(f"raw_responses config, field {where!r}: unknown budget policy {kind!r}; "
                             f"expected one of {POLICIES}")


def _run_local(context, config, model, preps: list[PreparedDataset], sampling) -> dict[str, dict]:
    from tqdm import tqdm

    from eagle3_assets.generation.local import generate_local

    out = {}
    for p in preps:
        bar = tqdm(total=len(p.requests), initial=p.already_done, desc=f"generate {p.dataset}", unit="sample",
                   file=sys.stderr)
        last = [time.monotonic()]

        def progress(rep, todo, bar=bar, last=last, ds=p.dataset):
            bar.update(rep.new - (bar.n - bar.initial))
            bar.set_postfix(tok_s=f"{rep.tokens_per_s:.0f}", tokens=rep.completion_tokens)
            if time.monotonic() - last[0] > 10 or rep.new == todo:
                last[0] = time.monotonic()
                context.log.info(f"{ds}: {rep.new}/{todo} new samples, {rep.completion_tokens:,} tokens, "
                                 f"{rep.tokens_per_s:.1f} tokens/s")

        try:
            rep = generate_local(model, p.todo, p.store, sampling, p.budget, max_new_tokens=config.max_new_tokens,
                                 batch_size=config.batch_size, progress=progress)
        finally:
            bar.close()
        out[p.dataset] = summarize(p, "local", rep)
    return out


def _run_http(context, config, backend, client_cfg, concurrency, preps, sampling):
    from eagle3_assets.generation.http_engine import EngineSettings, generate_datasets

    settings = EngineSettings(concurrency=concurrency, max_tokens=config.max_new_tokens, client=client_cfg, bar=True)
    context.log.info(f"{backend.source}: {len(preps)} dataset(s) through one gate of {concurrency} requests in flight")
    run = generate_datasets([p.job() for p in preps], backend, sampling=sampling, settings=settings,
                            progress=lambda p: context.log.info(p.line()))
    return {p.dataset: summarize(p, backend.source, run.lanes[p.dataset]) for p in preps}, run


def _metadata(s: dict, store_dir) -> dict:
    md = {k: v for k, v in s.items() if k not in ("dataset", "plan_before_run", "finish_reasons", "errors_by_reason",
                                                   "flags", "dead_runs")}
    if s.get("dead_runs"):
        md["dead_runs"] = md_table(s["dead_runs"])
    md["finish_reasons"] = md_table([{"finish_reason": k, "new": v} for k, v in sorted(s["finish_reasons"].items())])
    md["new_tool_call_replies"] = s["flags"].get("tool_call_reply", 0)
    md["new_replies_to_prompts_with_tools"] = s["flags"].get(TOOLS_SENT, 0)
    md["new_replies_without_a_call_despite_tools"] = s["flags"].get(TOOLS_UNUSED, 0)
    md["errors_by_reason"] = md_table([{"reason": k, "samples": v} for k, v in sorted(s["errors_by_reason"].items())])
    md["plan_before_run (estimate)"] = s["plan_before_run"]
    md["path"] = dg.MetadataValue.path(str(store_dir))
    return md


@dg.asset(
    partitions_def=datasets_partitions,
    deps=[prompts],
    group_name="generation",
    kinds={"jsonl"},
    backfill_policy=dg.BackfillPolicy.single_run(),
    description="Responses of the target model, resumable by sample id across sources, within the token budget. "
                "A backfill serves every selected dataset in one step (one in-flight gate for HTTP backends).",
    # storage, target, dataset_settings and every resource an engine serving generate reads (an engine's
    # own settings reach its role without this stage naming them)
    required_resource_keys={"storage", "target", "dataset_settings", *engine_resources("generate")},
)
def raw_responses(context: dg.AssetExecutionContext, config: GenerationConfig) -> dg.MaterializeResult:
    _validate(config)
    storage, target, dataset_settings = context.resources.storage, context.resources.target, context.resources.dataset_settings
    datasets = list(context.partition_keys)
    layout = storage.layout
    spec = target.spec()
    sampling = SamplingSettings(target=spec.name, temperature=config.temperature, top_p=config.top_p,
                                seed=config.seed, samples_per_prompt=config.samples_per_prompt)
    engine = engine_role("generate", config.backend)
    http = None if engine.in_process else engine.http(context.resources, spec, target.load_tokenizer, config.concurrency)
    backend = http.backend if http is not None else None
    preps = []
    for ds in datasets:
        policy = AdmissionPolicy(config.budget_policies.get(ds, config.budget_policy))
        try:
            p = prepare_dataset(layout, ds, sampling, source=config.backend, budget_tokens=dataset_settings.budget_for(ds),
                                policy=policy, max_tokens=config.max_new_tokens, max_samples=config.max_samples,
                                prices=getattr(backend, "prices", None), context_length=spec.context_length)
        except UserInputError as e:  # the user's to fix: the message, not a traceback; nothing was sent
            raise dg.Failure(description=str(e), allow_retries=False) from None
        if p.torn_bytes:
            context.log.warning(f"{ds}: dropped a torn last line ({p.torn_bytes} bytes) left by an interrupted run")
        context.log.info(f"{ds}: {len(p.requests)} samples planned, {p.already_done} on disk (all sources); budget "
                         f"{p.budget.limit:,} tokens ({policy.kind}), {p.budget.remaining:,} left; {p.plan.line()}")
        preps.append(p)

    run = None
    with pool_slot(context, "gpu") if engine.gpu else nullcontext():  # an engine on this deployment's GPUs
        if engine.in_process:
            summaries = _run_local(context, config, target.load_model(), preps, sampling)
        else:
            summaries, run = _run_http(context, config, backend, http.client, http.in_flight, preps, sampling)

    for p in preps:
        s = summaries[p.dataset]
        p.store.write_last_run({**s, "target": spec.name, "sampling": sampling.as_dict(), "finished_at": time.time()})
        line = missing_line(s)
        if line:
            context.log.warning(line)
        if s.get("billed_to_dead_runs_usd"):
            context.log.warning(f"{p.dataset}: ${s['billed_to_dead_runs_usd']:.6f} billed to {len(s['dead_runs'])} earlier "
                                f"run(s) that died, beyond what their replies showed ({s['billed_to_dead_runs_note']})")
        unused = unused_tools_line(p.dataset, s["flags"])
        if unused:
            context.log.warning(unused)
        context.add_asset_metadata(_metadata(s, p.store.dir), partition_key=p.dataset)
    if run is not None and run.client.get("loop_lag_ms_p99", 0.0) > SLOW_LOOP_MS:
        c = run.client
        context.log.warning(
            f"this process read replies late: its event loop ran {c['loop_lag_ms_p99']} ms late at p99 "
            f"({c['loop_lag_ms_max']} ms at worst) with {run.concurrency} in flight; replies delivered and not yet "
            "read are lost to a kill and bought again. Fewer in flight per run (or one run per group of datasets) "
            "keeps it short")
    if run is not None:
        from eagle3_assets.generation.http_engine import raise_for_stop

        raise_for_stop(run)
    common = {"target": spec.name, "sampling": sampling.as_dict(), "datasets_in_run": len(datasets)}
    if run is not None:
        common.update({
            "run_concurrency": run.concurrency, "run_in_flight_peak": run.in_flight_peak,
            "run_in_flight_mean": round(run.in_flight_mean, 1), "run_full_gate_share": round(run.full_gate_share, 4),
            "run_attempts": run.attempts, "run_billed_usd": run.billed_usd, "run_cost_usd_kept": run.cost_usd,
            "run_billed_to_dead_runs_usd": run.billed_to_dead_runs_usd,
            **{f"run_{k}": v for k, v in run.client.items()},
            "run_seconds": round(run.elapsed_s, 2),
            "run_backend_info": {k: v for k, v in run.backend_info.items() if not isinstance(v, dict)},
        })
    return dg.MaterializeResult(metadata=common)
