"""What running a GPU stage as a SLURM job costs over running it in the step, measured side by side.

Starts a private one-node SLURM (``tests.support.slurm_cluster``; root, Debian's slurm-wlm
and munge), builds a corpus of ``--prompts`` prompts with the embedded model, then materializes
``hidden_states`` alternately in the step (``launcher: local``, the yardstick) and as a SLURM job
(``launcher: slurm``), ``--repeats`` times each, from scratch every time. Prints per launch: the
step's wall time, and for SLURM the scheduler's own figures (queue wait, job run time from
``scontrol``) and the step's log times from submission to the job's start and from its end to the
step's end.

    .venv/bin/python benchmarks/slurm_launch.py [--prompts 32] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("EAGLE3_MODEL_CACHE", str(ROOT / "data" / "models"))

import dagster as dg  # noqa: E402
from results import record  # noqa: E402

from eagle3_assets.paths import DataLayout  # noqa: E402
from tests.support.slurm_cluster import local_slurm  # noqa: E402


def prompts(n: int) -> list[dict]:
    return [{"id": f"p{i}", "messages": [{"role": "user", "content": f"Name {i % 7 + 2} colours, one per line."}]}
            for i in range(n)]


def materialize(instance, selection, partition, run_config):
    from eagle3_assets.definitions import ALL_ASSETS, ALL_CHECKS, default_resources
    from eagle3_assets.resources import SlurmResource

    resources = {**default_resources(), "slurm": SlurmResource(poll_interval_s=0.5)}
    t0 = time.perf_counter()
    result = dg.materialize([*ALL_ASSETS, *ALL_CHECKS], selection=selection, partition_key=partition, instance=instance,
                            resources=resources, run_config=run_config, raise_on_error=False)
    wall = time.perf_counter() - t0
    if not result.success:
        raise SystemExit(f"{selection} failed: {[e.message for e in result.all_events if e.event_type_value == 'STEP_FAILURE']}")
    return result, wall


def log_times(instance, run_id: str) -> dict[str, float]:
    """Timestamps of the step's milestones, from the run's own event log."""
    marks = {}
    for rec in instance.all_logs(run_id):
        m = rec.user_message or ""
        for key, needle in (("submitted", "submitted SLURM job"), ("running", " is running on"), ("ended", " ended: state"),
                            ("step_end", 'Finished execution of step "hidden_states"')):
            if needle in m and key not in marks:
                marks[key] = rec.timestamp
    return marks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    print(f"load: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="eagle3-bench-slurm-") as tmp, local_slurm(Path(tmp) / "slurm") as cluster:
        os.environ.update(cluster.env())
        layout = DataLayout(Path(tmp) / "data")
        os.environ["EAGLE3_HOME"] = str(layout.root)
        os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
        src = layout.prompt_source("bench")
        src.parent.mkdir(parents=True)
        src.write_text("".join(json.dumps(p) + "\n" for p in prompts(args.prompts)))
        with dg.instance_for_test() as instance:
            instance.add_dynamic_partitions("datasets", ["bench"])
            materialize(instance, ["prompts", "raw_responses", "token_ids", "inventory", "merged_corpus"], "bench",
                        {"ops": {"raw_responses": {"config": {"max_new_tokens": 32, "batch_size": 8}}}})
            rows = {"local": [], "slurm": []}
            for rep in range(args.repeats):
                for launcher in ("local", "slurm"):
                    shutil.rmtree(layout.hidden_states_dir("bench"), ignore_errors=True)
                    result, wall = materialize(instance, ["hidden_states"], "bench",
                                               {"ops": {"hidden_states": {"config": {"launcher": launcher}}}})
                    meta = {k: v.value for k, v in result.asset_materializations_for_node("hidden_states")[0].metadata.items()}
                    row = {"wall_s": wall, "tokens": meta["tokens"], "extract_tokens_per_s": meta["tokens_per_s"]}
                    if launcher == "slurm":
                        marks = log_times(instance, result.run_id)
                        row |= {"queue_wait_s": meta["slurm_queue_wait_s"], "job_s": meta["slurm_elapsed_s"],
                                "submit_to_running_s": marks["running"] - marks["submitted"],
                                "end_to_step_end_s": marks["step_end"] - marks["ended"]}
                    rows[launcher].append(row)
                    print(f"run {rep + 1} {launcher:5s}: " + ", ".join(f"{k} {v:,.2f}" if isinstance(v, float) else f"{k} {v}"
                                                                     for k, v in row.items()), flush=True)
    local = statistics.median(r["wall_s"] for r in rows["local"])
    slurm = statistics.median(r["wall_s"] for r in rows["slurm"])
    print(f"\nmedian step wall time: in the step {local:.1f} s, as a SLURM job {slurm:.1f} s "
          f"(x{slurm / local:.2f}, +{slurm - local:.1f} s); load after: {os.getloadavg()}")
    record("slurm_launch", {"runs": rows, "median_local_wall_s": local, "median_slurm_wall_s": slurm,
                            "slurm_over_local": slurm / local})
    return 0


if __name__ == "__main__":
    sys.exit(main())
