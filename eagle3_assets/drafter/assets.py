"""``drafter_checkpoint``: an EAGLE-3 drafter per training recipe, trained on hidden-state shards.

Training runs in a separate process launched through Dagster Pipes (``torchrun`` when more
than one process is asked for), so the same trainer moves to a GPU cluster unchanged; the
asset then measures acceptance length by real chain speculative decoding on held-out prompts.
"""

import base64
import json
from typing import Any

import dagster as dg

from eagle3_assets.drafter.evaluate import eval_prompts, evaluate_drafter, train_split_sizes
from eagle3_assets.drafter.formats import serving_engines, target_notes
from eagle3_assets.drafter.recipes import RecipeError, list_recipes, load_recipe
from eagle3_assets.engines import engine_resources
from eagle3_assets.hidden_states.assets import ExtractionBackend, hidden_states
from eagle3_assets.launchers import Launch, LauncherName, forwarded_env, open_launcher
from eagle3_assets.metadata import md_table
from eagle3_assets.resources import SlurmJobConfig
from eagle3_assets.target.ref import TargetRef

recipe_partitions = dg.StaticPartitionsDefinition(list_recipes() or ["demo"])


class StreamingConfig(dg.Config):
    """Streaming mode (docs/streaming.md): with ``cap_bytes`` > 0 the step captures the recipe's hidden
    states while it trains, through a spool of at most that many bytes under the data root, with
    ``producers`` capture processes started through the step's launcher beside the trainer (on SLURM a
    job each, of ``slurm``'s shape, one node by default); ``hidden_states`` need not be materialized."""

    cap_bytes: int = 0
    producers: int = 1
    backend: ExtractionBackend = "local"  # the producers' capture engine (an extract engine, as hidden_states')
    python: str = ""  # the producers' interpreter ("": the launcher's), e.g. an environment holding SGLang
    tp_size: int = 1  # vllm: the producer's server over this many GPUs; sglang: one rank per producer (1)
    vllm_server_args: list[str] = []  # vllm: further arguments of the server each producer starts
    sglang_server_args: dict[str, Any] = {}  # sglang: further ServerArgs of each producer's capture
    slurm: SlurmJobConfig = SlurmJobConfig()  # launcher slurm: each producer's job shape over the resource's
    stale_s: float = 60.0  # a producer on another host whose heartbeat is older is dead: its unit goes back
    producer_restarts: int = 3  # producers that fail before the run is done are started again, this often in all
    unit_bytes: int = 256 << 20  # a unit, the grain of capture and deletion, holds at most this
    high_water: float = 0.9  # of the cap: producers start no unit the trainer is not waiting on above it ...
    low_water: float = 0.7  # ... until the spool is below this
    batch_tokens: int = 4096  # the producers' forward batch (padded tokens), as hidden_states' batch_tokens
    wait_timeout_s: float = 0.0  # the trainer gives up on a unit not published after this long (0: it waits)
    epochs: str = "recapture"  # "recapture" (capture every epoch again) or "keep" (refused unless all fits)
    progress_every_s: float = 30.0  # the step logs both sides' progress and the spool's bytes this often
    # the preflight's trainer idle estimate (tokens/s, all producers / all trainer ranks); 0: as measured by
    # earlier materializations (this recipe's last run, else its datasets' hidden_states extraction)
    capture_tokens_per_s: float = 0.0
    train_tokens_per_s: float = 0.0


class DrafterTrainingConfig(dg.Config):
    nproc_per_node: int = 1  # >1 launches torchrun with DDP (gloo on CPU, nccl on GPU)
    threads: int = 0  # torch threads per process (0: torch's default)
    device: str = "auto"
    dtype: str = "auto"  # compute dtype: auto is bf16 autocast on GPU, fp32 on CPU
    loader_workers: int = -1  # DataLoader workers per rank reading shards (-1: 2 on GPU, 0 on CPU)
    resume: bool = True
    launcher: LauncherName = "local"  # "local" (this machine) or "slurm" (one job: torchrun under srun on every task)
    slurm: SlurmJobConfig = SlurmJobConfig()  # launcher slurm: this launch's job shape over the resource's
    # The step's memory layout (docs/training.md#memory): -1 / "auto" lets the plan choose on a GPU
    micro_batch_tokens: int = -1  # real tokens per forward/backward (0: the rank's whole batch)
    activation_checkpointing: str = "auto"  # "auto", "on" or "off": recompute each TTT step's layer in backward
    loss_chunk_rows: int = -1  # rows of the draft head and softmaxes at a time (0: all at once)
    memory_fraction: float = 0.9  # of each GPU's memory the plan may fill
    gpu_memory_gib: float = 0.0  # plan for GPUs of this size before launching (0: this machine's GPU, if any)
    stream: StreamingConfig = StreamingConfig()  # streaming mode: off unless stream.cap_bytes > 0


def preflight_memory(recipe: str, job, target_config: dict, config: DrafterTrainingConfig, nodes: int = 1):
    """The step's memory estimate before any GPU is spent: for GPUs of ``gpu_memory_gib``, or this
    machine's GPU; refuses a recipe that cannot fit, naming the setting. None on a CPU-only host
    (each rank plans again on its own device when it starts). ``nodes``: the launcher's."""
    import torch

    from eagle3_assets.drafter.model import DrafterConfig
    from eagle3_assets.drafter.training.job import MemoryPlanError
    from eagle3_assets.drafter.training.memory_plan import plan_for_run, refusal

    capacity = int(config.gpu_memory_gib * (1 << 30)) if config.gpu_memory_gib > 0 else None
    if capacity is None and not torch.cuda.is_available():
        return None
    shape = job.shape
    cfg = DrafterConfig.from_target(target_config, draft_vocab_size=shape.draft_vocab_size, aux_layer_ids=shape.aux_layer_ids,
                                    intermediate_size=shape.intermediate_size, attention=shape.attention,
                                    **shape.layout())
    ranks = config.nproc_per_node * nodes
    plan = plan_for_run(cfg, job.training, job.runtime, torch.device("cuda", 0), world_size=max(1, ranks),
                        compute_bytes=4 if config.dtype == "float32" else 2, capacity=capacity)
    if not plan.fits():
        raise MemoryPlanError(f"recipe {recipe}: " + refusal(plan, max_length=job.training.max_length,
                                                             batch_size=job.training.batch_size, world_size=max(1, ranks),
                                                             per_node=config.nproc_per_node))
    return plan


def launch_training(context, config: DrafterTrainingConfig, launcher, recipe: str, job_path,
                    samples: float) -> dg.PipesClientCompletedInvocation:
    """The trainer through Pipes on the step's launcher: here (one process, or torchrun with
    ``nproc_per_node``), or one SLURM job running torchrun under srun on every task,
    ``nproc_per_node`` workers each."""
    launch = Launch(f"eagle3-drafter_checkpoint-{recipe}", "eagle3_assets.drafter.training", ["--config", str(job_path)],
                    procs=config.nproc_per_node, exports=forwarded_env(), plain_when_alone=True)
    context.log.info(f"training {recipe}: {samples:.0f} samples per epoch")
    return launcher.run(context, launch)


def producer_launcher(context, config: DrafterTrainingConfig, layout):
    """The streaming producers' launcher: the trainer's, with ``stream.slurm`` as the job shape on
    SLURM (one node, one task unless it says otherwise): each producer a job of its own."""
    from types import SimpleNamespace

    shape = config.stream.slurm
    shape = SlurmJobConfig(**{**shape.model_dump(), "nodes": shape.nodes or 1, "tasks_per_node": shape.tasks_per_node or 1})
    return open_launcher(config.launcher, context, SimpleNamespace(slurm=shape), layout)


@dg.asset(
    partitions_def=recipe_partitions,
    deps=[dg.AssetDep(hidden_states, partition_mapping=dg.AllPartitionMapping())],
    group_name="drafter",
    kinds={"pytorch", "safetensors"},
    pool="gpu",
    description="EAGLE-3 drafter trained on the recipe's hidden-state shards, exported for each serving engine its recipe names.",
    # slurm: the launcher's cluster; and every resource an engine serving extract reads (streaming's producers)
    required_resource_keys={"storage", "target", "slurm", *engine_resources("extract")},
)
def drafter_checkpoint(context: dg.AssetExecutionContext, config: DrafterTrainingConfig) -> dg.MaterializeResult:
    from eagle3_assets.drafter.training.config import ExportSettings, RuntimeSettings, TrainJob

    storage, target = context.resources.storage, context.resources.target
    recipe = load_recipe(context.partition_key)
    layout = storage.layout
    out = layout.drafter_dir(recipe.name)
    out.mkdir(parents=True, exist_ok=True)
    spec = target.spec()
    try:
        notes = target_notes(recipe.shape.attention, spec.config)
    except ValueError as exc:
        raise RecipeError(f"recipe {recipe.name}: field 'attention': {exc}") from None
    for note in notes:
        context.log.warning(f"recipe {recipe.name}: {note}")
    stream = None
    if config.stream.cap_bytes > 0:
        from eagle3_assets.drafter.stream_jobs import corpus_train_sizes, measured_rates, stream_settings_for

        rates = measured_rates(context.instance, recipe, config.stream)
        context.log.info(f"streaming: preflight rates {rates}")
        stream = stream_settings_for(layout, recipe, config.stream, rates)
        sizes = corpus_train_sizes(layout, recipe.datasets)
    else:
        sizes = train_split_sizes(layout, recipe.datasets, spec)
    samples = sum(w * sizes[d] for d, w in recipe.datasets.items())
    job = TrainJob(
        target=TargetRef.of(spec), out_dir=str(out),
        datasets={} if stream else {str(layout.hidden_states_dir(d)): float(w) for d, w in recipe.datasets.items()},
        stream=stream,
        training=recipe.training, shape=recipe.shape,
        runtime=RuntimeSettings(device=config.device, dtype=config.dtype, threads=config.threads,
                                loader_workers=config.loader_workers, resume=config.resume,
                                micro_batch_tokens=config.micro_batch_tokens,
                                activation_checkpointing=config.activation_checkpointing,
                                loss_chunk_rows=config.loss_chunk_rows, memory_fraction=config.memory_fraction),
        export=ExportSettings(speculative_k=recipe.evaluation.speculative_k), pipes_asset_key="drafter_checkpoint",
    )
    launcher = open_launcher(config.launcher, context, config, layout)
    plan = preflight_memory(recipe.name, job, spec.config, config, nodes=launcher.nodes)
    if plan is not None:
        context.log.info(f"training {recipe.name}: memory plan: {plan.describe()}")
    job_path = job.write(out / "job.json")
    stream_meta = {}
    if stream is None:
        invocation = launch_training(context, config, launcher, recipe.name, job_path, samples)
    else:
        from eagle3_assets.drafter.stream_run import StreamRun

        with StreamRun(context, stream, target, out, producer_launcher(context, config, layout),
                       f"eagle3-stream-producer-{recipe.name}", config.stream, context.resources) as run:
            invocation = launch_training(context, config, launcher, recipe.name, job_path, samples)
    pipes_meta = dict(invocation.metadata)
    for event in invocation.get_results():
        if isinstance(event, dg.MaterializeResult) and event.metadata:
            pipes_meta.update(event.metadata)
    result = json.loads((out / "result.json").read_text())
    if stream is not None:
        stream_meta = run.figures(result)
        context.log.info(f"streaming: {json.dumps(stream_meta)}")
    if result.get("stopped_early"):
        raise RuntimeError(f"training of {recipe.name} stopped before its last step; re-run to resume")

    prompts = eval_prompts(layout, recipe.datasets, recipe.evaluation.eval_samples)
    if not prompts:
        raise ValueError(f"recipe {recipe.name}: its datasets have no held-out (eval) samples to measure acceptance on")
    evaluation = evaluate_drafter(spec.model_dir, out, prompts, recipe, spec.stop_token_ids())
    (out / "eval.json").write_text(json.dumps(evaluation, indent=2))
    t, u = evaluation["trained"], evaluation["untrained"]
    context.log.info(f"acceptance length {t['acceptance_length']:.3f} (untrained {u['acceptance_length']:.3f}) "
                     f"on {len(prompts)} prompts")
    estimates = [{"step": e["step"], "EAL": round(e["eal"], 4),
                  "conditional acceptance per position": " / ".join(f"{a:.3f}" for a in e["acceptance_rate"]),
                  "exported": "yes" if e["step"] == result.get("exported_step") else ""}
                 for e in result.get("acceptance_estimates") or []]
    if estimates:
        context.log.info(f"exported step {result['exported_step']} of {result['steps']}; acceptance estimate at k="
                         f"{result['eal_k']}: best EAL {result['eal_best']:.3f} at step {result['eal_best_step']}, "
                         f"last {result['eal_last']:.3f}")
    curve = out / "training_curve.png"
    positions = [{"position": i + 1, "trained": a, "untrained": b}
                 for i, (a, b) in enumerate(zip(t["per_position_rate"], u["per_position_rate"]))]
    return dg.MaterializeResult(
        metadata={
            "acceptance_length": t["acceptance_length"],
            "acceptance_length_no_bonus": t["acceptance_length_no_bonus"],
            "untrained_acceptance_length": u["acceptance_length"],
            "acceptance_floor": recipe.evaluation.acceptance_floor,
            "acceptance_margin": recipe.evaluation.acceptance_margin,
            "matches_greedy": t["matches_greedy"],
            # drafts the evaluator decided by a near-tie, where an engine may draft the other token
            "evaluator_near_ties": t.get("near_ties", 0),
            "acceptance_per_position": md_table(positions),
            # each checkpoint's expected accepted length on the held-out shards, and which one was exported
            "acceptance_estimate": md_table(estimates),
            "eval_prompts": len(prompts),
            "train_samples_per_epoch": samples,
            "steps": result["total_steps"],
            "training_segments": len(result.get("segments") or []),  # runs of this training (a resume adds one)
            **{k: v for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
            **pipes_meta,
            **stream_meta,
            "training_curve": dg.MetadataValue.md(
                f"![training curve](data:image/png;base64,{base64.b64encode(curve.read_bytes()).decode()})"
                if curve.exists() else "_(no curve)_"),
            "target": f"{spec.name} (id {spec.identity['id']})",
            "attention": recipe.shape.attention,
            "serving_notes": "; ".join(notes) or "none",
            "memory_layout": json.dumps(result.get("memory_layout")),
            **{f"{engine}_export": dg.MetadataValue.path(str(out / engine)) for engine in serving_engines()},
        }
    )
