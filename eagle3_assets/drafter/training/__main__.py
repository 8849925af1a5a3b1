"""Entry point: ``python -m eagle3_assets.drafter.training --config job.json``.

Single process, or under ``torchrun --nproc-per-node N`` for data-parallel training (gloo on
CPU, nccl on GPU). Launched by Dagster Pipes (``DAGSTER_PIPES_CONTEXT`` set), rank 0 streams
progress and each checkpoint's acceptance estimate to the run's logs and reports the
materialization with the training figures (the estimate's among them: ``eal_best``,
``eal_best_step``, ``eal_last``, ``exported_step``).
"""

from __future__ import annotations

import json
import os
import sys

from eagle3_assets.drafter.training.acceptance import estimate_line
from eagle3_assets.drafter.training.config import TrainJob
from eagle3_assets.drafter.training.distributed import close_distributed
from eagle3_assets.drafter.training.job import MemoryPlanError, ShardDigestError, run_job
from eagle3_assets.drafter.training.stream import StreamFailed
from eagle3_assets.files import DiskFull, InsufficientDiskSpace
from eagle3_assets.hidden_states.spool.preflight import CapTooSmall
from eagle3_assets.job_file import run_job_main


def _run(job: TrainJob, args, pipes) -> int:
    if pipes is None:
        run_job(job)
        return 0
    every = max(1, (job.training.max_steps or 100) // 20)

    def report(m: dict) -> None:
        if m["step"] % every == 0:
            pipes.log.info(json.dumps({k: m[k] for k in ("step", "loss", "acc_per_step", "lr")}))
        if "acceptance_estimate" in m:
            pipes.log.info(estimate_line(m["acceptance_estimate"]))

    summary = run_job(job, on_metrics=report)
    meta = {k: v for k, v in summary.items() if isinstance(v, (int, float, str)) and v is not None}
    meta["final_acc_per_step"] = json.dumps(summary.get("final_acc_per_step"))
    pipes.report_asset_materialization(metadata=meta, asset_key=job.pipes_asset_key)
    return 0


def main(argv: list[str] | None = None) -> int:
    # rank 0 reports; a memory plan that does not fit is refused before any weight was built, a stream's cap
    # that cannot work before any plan is written, a shard that is not what extraction wrote before any row
    # of it was read; a full disk and a stream that cannot go on are one line too
    return run_job_main(TrainJob, _run, argv, reports=lambda job: int(os.environ.get("RANK", "0")) == 0,
                        refused=(MemoryPlanError, ShardDigestError, CapTooSmall, InsufficientDiskSpace, DiskFull,
                                 StreamFailed),
                        cleanup=close_distributed,
                        description="Train an EAGLE-3 drafter on hidden-state shards.")


if __name__ == "__main__":
    sys.exit(main())
