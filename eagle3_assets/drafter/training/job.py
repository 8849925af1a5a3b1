"""One training run from a :class:`TrainJob`: data, vocabulary map, drafter, teacher, loop, export.

Every rank builds the same dataset index and token counts; rank 0 writes the vocabulary
map (the others read it after a barrier), trains with the rest, and alone writes the
exports and ``result.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from eagle3_assets.drafter.export_fingerprint import fingerprints
from eagle3_assets.drafter.model import DrafterConfig, build_drafter
from eagle3_assets.drafter.target_weights import (
    read_target_embeddings,
    read_target_final_norm,
    read_target_lm_head,
)
from eagle3_assets.drafter.training.acceptance import estimate_line, estimate_summary
from eagle3_assets.drafter.training.config import TrainJob
from eagle3_assets.drafter.training.data import ShardBatches, ShardDataset, eval_split
from eagle3_assets.drafter.training.distributed import barrier, dist_info, gather_lists, init_distributed
from eagle3_assets.drafter.training.loop import Trainer
from eagle3_assets.drafter.training.memory_plan import GiB, MemoryEstimate, plan_for_run, refusal
from eagle3_assets.drafter.training.teacher import Teacher
from eagle3_assets.drafter.vocab_map import check_vocab_map, counts_hash, load_or_build_vocab_map
from eagle3_assets.files import write_text_atomic
from eagle3_assets.target.ref import OpenTarget


def compute_dtype(job: TrainJob, device: torch.device) -> torch.dtype:
    if job.runtime.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, job.runtime.dtype)


def drafter_config(job: TrainJob, dataset: ShardDataset, target: OpenTarget | None = None) -> DrafterConfig:
    """The drafter's shape; its aux layers are the ones the shards hold (a recipe that names
    others is refused: training on one set of layers and serving another is silent damage).
    ``target``: the job's target, opened by the caller (default: opened here)."""
    target = target or job.target.open()
    stored = dataset.aux_layer_ids
    wanted = job.shape.aux_layer_ids
    if wanted is not None and stored is not None and list(wanted) != stored:
        raise ValueError(f"the recipe asks for aux layers {list(wanted)} but the hidden states hold {stored}: "
                         "re-extract with those layer_ids or drop aux_layer_ids from the recipe")
    cfg = DrafterConfig.from_target(target.config, draft_vocab_size=job.shape.draft_vocab_size,
                                    aux_layer_ids=wanted or stored, intermediate_size=job.shape.intermediate_size,
                                    attention=job.shape.attention, **job.shape.layout())
    if dataset.readers and dataset.hidden_size != cfg.target_hidden_size:
        raise ValueError(f"the hidden states have hidden size {dataset.hidden_size}, the target {cfg.target_hidden_size}")
    return cfg


def head_from_target(model, lm_head: torch.Tensor, final_norm: torch.Tensor, *, freeze: bool = False):
    """Start the draft head as the target's: its rows of the draft vocabulary and its final norm,
    so the drafter first has to reproduce the target's last hidden state, not learn a head;
    ``freeze`` keeps both there (the optimizer never sees them)."""
    with torch.no_grad():
        rows = model.d2t + torch.arange(model.d2t.numel(), device=model.d2t.device)
        model.lm_head.weight.copy_(lm_head[rows.to(lm_head.device)])
        model.norm.weight.copy_(final_norm)
    for p in (model.lm_head.weight, model.norm.weight):
        p.requires_grad_(not freeze)
    return model


class MemoryPlanError(ValueError):
    """The recipe's step does not fit the device, in any layout the plan knows."""


class ShardDigestError(ValueError):
    """A shard the run would train on is not what extraction wrote (missing, resized, other bytes)."""


def verify_shards_read_back(dataset: ShardDataset, rank: int, world: int) -> None:
    """Every shard checked against its manifest's sha256 before training reads a row: the ranks
    share the hashing, and every rank refuses with all of what they found."""
    t0 = time.perf_counter()
    mine, read = dataset.verify_files(rank, world, threads=min(8, os.cpu_count() or 1))
    problems = gather_lists(mine)
    if problems:
        more = f" and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise ShardDigestError(f"{len(problems)} shard(s) differ from their manifest: {'; '.join(problems[:5])}{more}")
    if rank == 0:
        print(f"eagle3: shards checked against their manifests' sha256 ({read / 2**30:.2f} GiB on rank 0 in "
              f"{time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)


def memory_plan(job: TrainJob, dcfg: DrafterConfig, device: torch.device, world: int, dtype: torch.dtype) -> MemoryEstimate:
    """The step's memory layout and estimate for this rank's device; refuses one that cannot fit."""
    plan = plan_for_run(dcfg, job.training, job.runtime, device, world_size=world,
                        compute_bytes=torch.finfo(dtype).bits // 8)
    if not plan.fits():
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or world  # torchrun's processes on this node
        raise MemoryPlanError(refusal(plan, max_length=job.training.max_length, batch_size=job.training.batch_size,
                                      world_size=world, per_node=per_node))
    return plan


@contextmanager
def growing_segments():
    """``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` while training, unless the user set it.

    Read at the first CUDA allocation: segments that grow instead of a new block for every size, so
    a step's varying shapes do not strand memory (137 of 141 GiB reserved for 67 allocated, without).
    Taken back afterwards, so engines started later from the same process (vLLM's hidden-states
    connector refuses the setting) never inherit it.
    """
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        yield
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    try:
        yield
    finally:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)


def exported_engines(job: TrainJob) -> tuple[str, ...]:
    """The engines whose exports the job writes: the recipe's, narrowed by the job's export settings."""
    e = job.export
    return () if e is None else tuple(x for x in job.shape.engines if e.engines is None or x in e.engines)


def run_job(job: TrainJob, on_metrics=None) -> dict:
    """Train (or resume) the job's drafter; rank 0 exports it and writes ``result.json``."""
    with growing_segments():
        return _run_job(job, on_metrics)


def _run_job(job: TrainJob, on_metrics) -> dict:
    t_start = time.perf_counter()
    if job.runtime.threads > 0:
        torch.set_num_threads(job.runtime.threads)
    device = init_distributed(job.runtime.device)
    rank, world = dist_info()
    out_dir = Path(job.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    s = job.training
    stream = None
    target = job.target.open()
    if job.stream is not None:  # the spool, filled by producers while this trains (drafter/training/stream.py)
        from eagle3_assets.drafter.training.stream import open_stream

        dataset, plan, stream = open_stream(job.stream, s, rank=rank, world=world, target_config=target.config,
                                            out_dir=out_dir)
    else:
        dataset = ShardDataset(job.datasets, max_length=s.max_length, seed=s.seed)
        verify_shards_read_back(dataset, rank, world)
    dcfg = drafter_config(job, dataset, target)
    counts = dataset.token_counts(dcfg.vocab_size)
    if rank == 0:
        vmap = load_or_build_vocab_map(out_dir, counts, dcfg.draft_vocab_size)
    barrier()
    if rank != 0:
        vmap = load_or_build_vocab_map(out_dir, counts, dcfg.draft_vocab_size)
    check_vocab_map(vmap, source_hash=counts_hash(counts))

    workers = job.runtime.loader_workers if job.runtime.loader_workers >= 0 else (2 if device.type == "cuda" else 0)
    data = stream or ShardBatches(dataset, s.batch_size, seed=s.seed, rank=rank, world_size=world, workers=workers,
                                  pin_memory=device.type == "cuda")
    eval_data = None  # the acceptance estimate's held-out samples: a streamed run's spool holds no eval split
    held_out = eval_split(job.datasets, max_length=s.max_length, samples=s.eal_samples) if s.eal_samples else None
    if stream is None and held_out is not None:
        eval_data = ShardBatches(held_out, s.batch_size, seed=s.seed, rank=rank, world_size=world, shuffle=False)
    dtype = compute_dtype(job, device)
    plan = memory_plan(job, dcfg, device, world, dtype)
    if rank == 0:
        print(f"eagle3: memory plan: {plan.describe()}", file=sys.stderr, flush=True)
    # built on the device in place: no float32 CPU copy of the frozen embedding or default init of the weights
    model = build_drafter(dcfg, read_target_embeddings(target.model_dir), vmap, device=device, embed_dtype=dtype,
                          seed=s.seed if job.init_seed is None else job.init_seed)
    lm_head = read_target_lm_head(target.model_dir, target.config)
    if s.init_head_from_target:
        head_from_target(model, lm_head, read_target_final_norm(target.model_dir), freeze=s.freeze_head)
    if rank == 0:  # a disk too small for the checkpoints is refused now, not at the first checkpoint
        from eagle3_assets.drafter.training.checkpoints import require_room

        e = job.export
        require_room(out_dir, model, s.keep_checkpoints, exports=len(exported_engines(job)))
    teacher = Teacher(lm_head, vmap, device=device, dtype=dtype)
    del lm_head
    trainer = Trainer(s, model, data, teacher, out_dir, compute_dtype=dtype, vocab_hash=vmap.source_hash,
                      progress=job.runtime.progress, packed=job.runtime.packed, memory=plan.memory,
                      eval_data=eval_data, eal_k=job.export.speculative_k if job.export else None)
    setup_s = time.perf_counter() - t_start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def announce(m: dict) -> None:  # each checkpoint's acceptance estimate in the log
        if "acceptance_estimate" in m:
            print(f"eagle3: {estimate_line(m['acceptance_estimate'])}", file=sys.stderr, flush=True)
        if on_metrics is not None:
            on_metrics(m)

    result = trainer.run(resume=job.runtime.resume, stop_after=job.runtime.stop_after, on_metrics=announce)

    summary = {**result.summary, "world_size": world, "vocab_map": vmap.summary(), "total_steps": trainer.total_steps,
               "train_samples_per_epoch": len(dataset), "batches_per_epoch": len(data), "compute_dtype": str(dtype),
               "checkpoint": str(result.checkpoint) if result.checkpoint else None,
               "metrics_path": str(result.metrics_path) if result.metrics_path else None,
               "curve_path": str(result.curve_path) if result.curve_path else None,
               "stopped_early": result.stopped_early, "setup_s": setup_s,
               "memory_layout": plan.memory.to_dict(), "memory_estimated_gib": plan.peak / GiB,
               **estimate_summary(result.metrics, trainer.eal_k)}
    if stream is not None:
        from eagle3_assets.drafter.training.stream import finish_stream

        summary["stream"] = finish_stream(stream, result, rank)
    if device.type == "cuda":
        summary["memory_peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GiB
        summary["memory_peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GiB
    if rank == 0 and job.export and not result.stopped_early:
        from eagle3_assets.drafter import formats

        e = job.export
        best = trainer.use_best() if s.export_best else None  # the export is the best checkpoint's weights
        summary["exported_step"] = best["step"] if best else result.steps
        if best and best["step"] != result.steps:
            print(f"eagle3: exporting step {best['step']}, the best by the acceptance estimate "
                  f"(EAL {summary['eal_best']:.3f} against {summary['eal_last']:.3f} at step {result.steps})",
                  file=sys.stderr, flush=True)
        for engine in exported_engines(job):
            summary[f"{engine}_dir"] = str(formats.export(engine, model, out_dir / engine, dtype=e.dtype,
                                                          verifier=str(target.model_dir), speculative_tokens=e.speculative_k))
        summary["exports"] = fingerprints(out_dir, job.shape.engines)  # every file as written, for reading back
    if rank == 0:
        write_text_atomic(out_dir / "result.json", json.dumps(summary, indent=2))
    barrier()
    return summary
