"""Hidden states through SGLang with tensor parallelism: the ``torchrun`` entry point.

    torchrun --nproc-per-node=<tp> -m eagle3_assets.hidden_states.sglang_extract --config job.json

Each rank builds its share of the target in the job's engine (its extract role's ``capture``:
SGLang's, ``engines/sglang/capture.py``); rank 0 runs the
same extraction as the local backend (``extract_corpus``: resume, batching by length,
quarantine, shards, index and manifest) and every other rank mirrors its forwards
(:mod:`~eagle3_assets.hidden_states.tensor_parallel`). One job is one tensor-parallel
group (``WORLD_SIZE == tp_size``); datasets are partitions, so several GPU boxes extract
several datasets at once. Launched by Dagster Pipes, rank 0 logs progress to the run.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Literal

from pydantic import Field

from eagle3_assets.engines import engine_role
from eagle3_assets.hidden_states.extract import ExtractionReport, extract_corpus
from eagle3_assets.hidden_states.tensor_parallel import Group, LeaderExtractor, follow, init_tensor_parallel
from eagle3_assets.job_file import JobFile, run_job_main
from eagle3_assets.target import layers as hidden_layers
from eagle3_assets.target.ref import OpenTarget, TargetRef

REPORT = "extraction-report.json"


class SGLangExtractionJob(JobFile):
    """One extraction run; the asset writes it, every rank reads it."""

    engine: str = "sglang"  # the engine whose extract role (tensor_parallel) captures on every rank
    target: TargetRef  # the target (its sizes are read from it, once, on each rank)
    corpus: str  # merged-corpus Parquet
    out_dir: str  # the dataset's hidden-state directory
    layer_ids: list[int] | None = None  # None: the default aux layers
    tp_size: int = Field(1, ge=1)
    dtype: Literal["bf16", "fp8"] = "bf16"  # shard storage
    shard_bytes: int = Field(1 << 30, ge=1)
    batch_tokens: int = Field(16384, ge=1)  # tokens per forward, in whole KV pages (a longer row runs alone)
    max_rows: int = Field(256, ge=1)  # requests per forward (the request pool's size)
    max_length: int | None = Field(None, ge=1)  # the target's context: longer rows are quarantined, never run
    retry_quarantined: bool = False
    model_dtype: str = "auto"  # the target's dtype; auto: bfloat16 where the rank sees a GPU, else float32
    server_args: dict = Field(default_factory=dict)  # further ServerArgs fields (e.g. mem_fraction_static)
    nodes: int = Field(1, ge=1)  # >1: a TP group per node (SLURM_PROCID), each its share into parts/


def longest_row(job: SGLangExtractionJob) -> int:
    """The longest corpus row the capture will run (rows over ``max_length`` are quarantined):
    what the KV pool is sized for, on every rank alike."""
    import polars as pl

    n = pl.scan_parquet(job.corpus).select(pl.col("input_ids").list.len().alias("n"))
    if job.max_length is not None:
        n = n.filter(pl.col("n") <= job.max_length)
    return int(n.select(pl.col("n").max()).collect().item() or 1)


def engine_capture(job: SGLangExtractionJob, group: Group, layer_ids: list[int]):
    """The real capture: this rank's share of the model in the job's engine (its extract role's
    ``capture``; SGLang's ModelRunner), its KV pool sized from the longest row."""
    return engine_role("extract", job.engine).capture(job, group, layer_ids, longest_row=longest_row(job))


def describe(job: SGLangExtractionJob, target: OpenTarget, layer_ids: list[int], backend: str) -> dict:
    return {"target": target.identity, "layers": hidden_layers.convention(layer_ids, target.num_layers),
            "backend": f"{backend} tp{job.tp_size}"}


def run_extraction(job: SGLangExtractionJob, capture_factory=engine_capture, *, backend: str | None = None,
                   progress=None) -> ExtractionReport | None:
    """This rank's part of the job; rank 0 returns the report (and writes it beside the shards)."""
    group = init_tensor_parallel(job.tp_size)
    target = job.target.open()
    layer_ids = hidden_layers.resolve_layer_ids(target.num_layers, job.layer_ids)
    capture = capture_factory(job, group, layer_ids)
    if group.rank != 0:
        follow(capture, group)
        return None
    if backend is None:
        backend = engine_role("extract", job.engine).label()
    leader = LeaderExtractor(capture, group, hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                             max_rows=job.max_rows, max_length=job.max_length,
                             page_size=getattr(capture, "page_size", 1), describe=describe(job, target, layer_ids, backend))
    node, out, share, skip = node_of_job(job), Path(job.out_dir), None, None
    if job.nodes > 1:
        from eagle3_assets.hidden_states.parts import part_dir, stored_ids

        out, share, skip = part_dir(job.out_dir, node, job.nodes), (node, job.nodes), stored_ids(job.out_dir)
        print(f"eagle3: extraction node {node}/{job.nodes} on {os.uname().nodename}: its share into {out}", flush=True)
    try:
        report = extract_corpus(job.corpus, out, leader, dtype=job.dtype, shard_bytes=job.shard_bytes,
                                batch_tokens=job.batch_tokens, retry_quarantined=job.retry_quarantined,
                                progress=progress, share=share, skip_ids=skip)
    finally:
        leader.stop()
    if job.nodes > 1:
        from eagle3_assets.hidden_states.parts import write_report

        write_report(Path(job.out_dir), report, node, job.nodes)
    else:
        (Path(job.out_dir) / REPORT).write_text(json.dumps(asdict(report), indent=2))
    return report


def node_of_job(job: SGLangExtractionJob) -> int:
    """This TP group's node in a job of ``job.nodes`` (one SLURM task, one standalone torchrun, per node)."""
    if job.nodes <= 1:
        return 0
    node = int(os.environ.get("SLURM_PROCID", "-1"))
    if not 0 <= node < job.nodes:
        raise ValueError(f"a {job.nodes}-node SGLang extraction runs one SLURM task per node (SLURM_PROCID "
                         f"{os.environ.get('SLURM_PROCID')!r})")
    return node


def load_report(out_dir: Path | str) -> ExtractionReport:
    return ExtractionReport(**json.loads((Path(out_dir) / REPORT).read_text()))


def _factory(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _run(job: SGLangExtractionJob, args, pipes) -> int:
    factory = _factory(args.capture) if args.capture else engine_capture
    backend = None if args.capture is None else args.capture
    last = [time.monotonic()]

    def progress(rep: ExtractionReport) -> None:
        if pipes is not None and time.monotonic() - last[0] > 10:
            last[0] = time.monotonic()
            pipes.log.info(f"{rep.extracted} samples, {rep.tokens_extracted:,}/{rep.tokens_todo:,} tokens, "
                           f"{rep.tokens_per_s:,.0f} tokens/s")

    run_extraction(job, factory, backend=backend, progress=progress)
    return 0


def _reports(job: SGLangExtractionJob) -> bool:
    """Rank 0 of the first node's group reports to Dagster."""
    first_node = int(os.environ.get("SLURM_PROCID", "0")) == 0 or job.nodes == 1
    return int(os.environ.get("RANK", "0")) == 0 and first_node


def _close_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    return run_job_main(SGLangExtractionJob, _run, argv, reports=_reports, cleanup=_close_group,
                        description="Extract EAGLE-3 hidden states through SGLang (one TP group).",
                        options={"--capture": dict(default=None, help="module:function building the capture "
                                                   "(default: SGLang's)")})


if __name__ == "__main__":
    sys.exit(main())
