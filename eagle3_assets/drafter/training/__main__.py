"""Entry point: ``python -m eagle3_assets.drafter.training --config job.json``.

Single process, or under ``torchrun --nproc-per-node N`` for data-parallel training (gloo on
CPU, nccl on GPU). Launched by Dagster Pipes (``DAGSTER_PIPES_CONTEXT`` set), rank 0 streams
progress to the run's logs and reports the materialization with the training figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from eagle3_assets.drafter.training.config import TrainJob
from eagle3_assets.drafter.training.distributed import close_distributed
from eagle3_assets.drafter.training.job import MemoryPlanError, run_job


def _open_pipes():
    """The Dagster Pipes context when this process was launched by Pipes, else None."""
    if not os.environ.get("DAGSTER_PIPES_CONTEXT"):
        return None
    try:
        from dagster_pipes import open_dagster_pipes
    except ImportError:
        return None
    return open_dagster_pipes()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Train an EAGLE-3 drafter on hidden-state shards.")
    ap.add_argument("--config", required=True, help="a TrainJob as JSON")
    args = ap.parse_args(argv)
    try:
        job = TrainJob.from_json(args.config)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    pipes = _open_pipes() if int(os.environ.get("RANK", "0")) == 0 else None
    try:
        if pipes is None:
            run_job(job)
            return 0
        with pipes:
            every = max(1, (job.training.max_steps or 100) // 20)

            def report(m: dict) -> None:
                if m["step"] % every == 0:
                    pipes.log.info(json.dumps({k: m[k] for k in ("step", "loss", "acc_per_step", "lr")}))

            summary = run_job(job, on_metrics=report)
            meta = {k: v for k, v in summary.items() if isinstance(v, (int, float, str)) and v is not None}
            meta["final_acc_per_step"] = json.dumps(summary.get("final_acc_per_step"))
            pipes.report_asset_materialization(metadata=meta, asset_key=job.pipes_asset_key)
    except MemoryPlanError as exc:  # refused before any weight was built
        print(f"error: {job.out_dir}: {exc}", file=sys.stderr)
        return 2
    finally:
        close_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
