"""Hidden states as a job of their own: what a launched job runs for an engine that is not tensor-parallel (local, vLLM).

    python -m eagle3_assets.hidden_states.extract_job --config job.json

The same ``extract_corpus`` as the in-process asset (resume, batching, quarantine, shards, index,
manifest), with the extractor the engine's extract role builds on this node (vLLM's: an extraction
server this job starts on its own node, its files on node-local disk, read by this process, stopped
at the end). Rank 0 of a job
launched by Dagster Pipes logs progress to the run; the report is written beside the shards
(``extraction-report.json``), where the asset reads it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Literal

from pydantic import Field

from eagle3_assets.engines import engine_names, engine_role
from eagle3_assets.engines.vllm.extraction import VLLMServerSpec
from eagle3_assets.hidden_states.extract import ExtractionReport, extract_corpus
from eagle3_assets.job_file import JobFile, run_job_main
from eagle3_assets.target.ref import TargetRef

REPORT = "extraction-report.json"  # the same file the SGLang job writes (sglang_extract.load_report reads both)


class ExtractionJob(JobFile):
    """One dataset's extraction; the asset writes it, the job reads it."""

    backend: Literal[engine_names("extract")]  # an engine whose extract role runs in this job (not tensor_parallel)
    target: TargetRef
    corpus: str
    out_dir: str
    layer_ids: list[int] | None = None
    device: str = "auto"  # local backend; auto: cuda where the node sees a GPU, else cpu
    model_dtype: str = "auto"  # local backend: the target's dtype (auto: bfloat16 on a GPU, float32 on a CPU)
    dtype: Literal["bf16", "fp8"] = "bf16"  # shard storage
    shard_bytes: int = Field(1 << 30, ge=1)
    batch_tokens: int = Field(4096, ge=1)
    retry_quarantined: bool = False
    threads: int = Field(0, ge=0)
    vllm: VLLMServerSpec | None = None
    nodes: int = Field(1, ge=1)  # >1: one process per node (SLURM_PROCID), each its share into parts/


def build_extractor(job: ExtractionJob, stack: ExitStack):
    """The job's engine's extractor on this node (its extract role); what it starts stops with ``stack``."""
    return engine_role("extract", job.backend).job_extractor(job, stack)


def run_extraction(job: ExtractionJob, progress=None) -> ExtractionReport:
    if job.threads:
        import torch

        torch.set_num_threads(job.threads)
    rank, world = job_rank(job)
    out, share, skip = Path(job.out_dir), None, None
    if world > 1:
        from eagle3_assets.hidden_states.parts import part_dir, stored_ids

        out, share, skip = part_dir(job.out_dir, rank, world), (rank, world), stored_ids(job.out_dir)
        print(f"eagle3: extraction node {rank}/{world} on {os.uname().nodename}: its share into {out}", flush=True)
    with ExitStack() as stack:
        extractor = build_extractor(job, stack)
        report = extract_corpus(job.corpus, out, extractor, dtype=job.dtype, shard_bytes=job.shard_bytes,
                                batch_tokens=job.batch_tokens, retry_quarantined=job.retry_quarantined,
                                progress=progress, share=share, skip_ids=skip)
    if world > 1:
        from eagle3_assets.hidden_states.parts import write_report

        write_report(Path(job.out_dir), report, rank, world)
    else:
        (Path(job.out_dir) / REPORT).write_text(json.dumps(asdict(report), indent=2))
    return report


def job_rank(job: ExtractionJob) -> tuple[int, int]:
    """(this process's node, the job's node count): SLURM's task id in a data-parallel job."""
    if job.nodes <= 1:
        return 0, 1
    rank = int(os.environ.get("SLURM_PROCID", "-1"))
    if not 0 <= rank < job.nodes or int(os.environ.get("SLURM_NTASKS", "0")) != job.nodes:
        raise ValueError(f"a {job.nodes}-node extraction runs as one SLURM task per node (SLURM_PROCID "
                         f"{os.environ.get('SLURM_PROCID')!r}, SLURM_NTASKS {os.environ.get('SLURM_NTASKS')!r})")
    return rank, job.nodes


def _stop_on_sigterm(signum, frame):
    # SLURM ends a cancelled or timed-out job with SIGTERM: unwind, so the vLLM server is stopped too
    raise SystemExit(128 + signum)


def _run(job: ExtractionJob, args, pipes) -> int:
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    if pipes is None:
        run_extraction(job)
        return 0
    last = [time.monotonic()]

    def progress(rep: ExtractionReport) -> None:
        if time.monotonic() - last[0] > 10:
            last[0] = time.monotonic()
            pipes.log.info(f"{rep.extracted} samples, {rep.tokens_extracted:,}/{rep.tokens_todo:,} tokens, "
                           f"{rep.tokens_per_s:,.0f} tokens/s")

    report = run_extraction(job, progress)
    pipes.log.info(f"extracted {report.extracted} samples ({report.tokens_extracted:,} tokens) in "
                   f"{report.seconds:.0f} s; {report.already_done} were already stored")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_job_main(ExtractionJob, _run, argv, reports=lambda job: job_rank(job)[0] == 0,  # one node reports
                        description="Extract EAGLE-3 hidden states for one dataset (local or vLLM backend).")


if __name__ == "__main__":
    sys.exit(main())
