"""Two SLURM nodes next to one: the same extraction and the same training job on a private one-node
cluster and on the two-namespace cluster (``tests.support.slurm_two_nodes``), side by side.

Builds a corpus of ``--prompts`` prompts with the embedded model, then, each as a SLURM job:

- ``hidden_states`` (local backend, one sample a forward), after one uncounted warm-up job: on
  one node with 2 threads, and data-parallel on two nodes with 1 thread each (the same two cores:
  what the second node buys here is the split, not hardware); tokens/s over the job's run time
  (``scontrol``, model loading included) and over the extraction itself (the slowest node's), the
  step's wall time, and the largest difference
  between the two sets of states (2 threads against 1 changes a matmul's summation order, so the
  last bits may differ; the tests compare at equal threads, bit for bit);
- ``drafter_checkpoint``: on one node as 2 tasks and on two nodes as 1 task each (the same global
  batch), the trainer's tokens/s (all ranks, its loop's wall time), the job's run time, the step's
  wall time, and the largest weight difference;
- a node lost: node 2 killed after the training job's first checkpoint (the seconds until the
  run failed, from the kill), then after its first extraction shard (the samples the relaunch
  extracted again, counted from the shard files on disk).

Root, Debian's slurm-wlm and munge, and iproute2 are needed, as for the tests marked ``slurm``.

    .venv/bin/python benchmarks/slurm_two_nodes.py [--prompts 24]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("EAGLE3_MODEL_CACHE", str(ROOT / "data" / "models"))

import dagster as dg  # noqa: E402
from results import record  # noqa: E402
from slurm_launch import prompts  # noqa: E402

from eagle3_assets.definitions import ALL_ASSETS, default_resources  # noqa: E402
from eagle3_assets.paths import DataLayout  # noqa: E402
from eagle3_assets.resources import DatasetSettings  # noqa: E402
from tests.support.slurm_cluster import local_slurm  # noqa: E402
from tests.support.slurm_two_nodes import two_node_slurm  # noqa: E402

RECIPE = """
description = "two-node benchmark"
draft_vocab_size = 512
intermediate_size = 256
ttt_steps = 2
lr = 3e-3
warmup_steps = 1
max_steps = 24
batch_size = 2
max_length = 64
seed = 0
checkpoint_every = 4
acceptance_floor = 1.0
eval_max_new_tokens = 4
eval_samples = 2
speculative_k = 2

[datasets]
bench = 1.0
"""


def launch(instance, asset: str, partition: str, config: dict, conf: Path, threads: int):
    """One materialization against the cluster ``conf``; (result, wall seconds)."""
    from eagle3_assets.definitions import ALL_CHECKS
    from eagle3_assets.resources import SlurmResource

    os.environ["SLURM_CONF"], os.environ["OMP_NUM_THREADS"] = str(conf), str(threads)
    t0 = time.perf_counter()
    result = dg.materialize([*ALL_ASSETS, *ALL_CHECKS], selection=[asset], partition_key=partition, instance=instance,
                            resources={**default_resources(), "slurm": SlurmResource(poll_interval_s=0.5)},
                            run_config={"ops": {asset: {"config": config}}}, raise_on_error=False)
    return result, time.perf_counter() - t0


def meta_of(result, asset: str) -> dict:
    return {k: v.value for k, v in result.asset_materializations_for_node(asset)[0].metadata.items()}


def failures(result) -> list[str]:
    return [e.step_failure_data.error.message for e in result.all_events if e.event_type_value == "STEP_FAILURE"]


def states_diff(a: Path, b: Path) -> float:
    from eagle3_assets.hidden_states.reader import ShardReader

    x, y = ShardReader(a), ShardReader(b)
    assert sorted(x.sample_ids()) == sorted(y.sample_ids())
    return max(max(float((p.aux_hidden.float() - q.aux_hidden.float()).abs().max()),
                   float((p.last_hidden.float() - q.last_hidden.float()).abs().max()))
               for p, q in ((x.read(s), y.read(s)) for s in x.sample_ids()))


def weights_diff(a: Path, b: Path) -> float:
    from eagle3_assets.drafter.training.checkpoints import latest_checkpoint, load_checkpoint

    x, y = load_checkpoint(latest_checkpoint(a)), load_checkpoint(latest_checkpoint(b))
    return max(float((t.float() - y["model"][k].float()).abs().max()) for k, t in x["model"].items())


def stored_in_files(directory: Path) -> list[str]:
    from safetensors import safe_open

    ids = []
    for f in sorted(directory.rglob("shard-*.safetensors")):
        with safe_open(str(f), "pt") as h:
            ids += json.loads(h.metadata()["sample_ids"])
    return ids


def kill_when(two, path_glob, base: Path, marks: dict) -> threading.Thread:
    def watch():
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and not list(base.glob(path_glob)):
            time.sleep(0.02)
        marks["killed_at"] = time.monotonic()
        two.kill_node(1)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=24)
    args = ap.parse_args()
    figures: dict = {}
    print(f"load: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="eagle3-bench-2n-") as tmp, \
            local_slurm(Path(tmp) / "one") as one, two_node_slurm(Path(tmp) / "two") as two:
        layout = DataLayout(Path(tmp) / "data")
        os.environ["EAGLE3_HOME"] = str(layout.root)
        src = layout.prompt_source("bench")
        src.parent.mkdir(parents=True)
        src.write_text("".join(json.dumps(p) + "\n" for p in prompts(args.prompts)))
        (layout.root / "recipes").mkdir()
        (layout.root / "recipes" / "demo.toml").write_text(RECIPE)
        with dg.instance_for_test() as instance:
            instance.add_dynamic_partitions("datasets", ["bench"])
            res = dg.materialize(ALL_ASSETS, selection=["prompts", "raw_responses", "token_ids", "inventory", "merged_corpus"],
                                 partition_key="bench", instance=instance,
                                 resources={**default_resources(), "dataset_settings": DatasetSettings(eval_fraction=0.25)},
                                 run_config={"ops": {"raw_responses": {"config": {"max_new_tokens": 32, "batch_size": 8}}}})
            assert res.success
            out = layout.hidden_states_dir("bench")
            extract = {"launcher": "slurm", "batch_tokens": 1, "shard_bytes": 1}
            # a first job warms the page cache, the imports' bytecode and the model files: not counted
            launch(instance, "hidden_states", "bench", {**extract, "slurm": {}}, one.conf, 2)
            for name, conf, threads, shape in (("one_node", one.conf, 2, {}), ("two_nodes", two.conf, 1, {"nodes": 2})):
                shutil.rmtree(out, ignore_errors=True)
                result, wall = launch(instance, "hidden_states", "bench", {**extract, "slurm": shape}, conf, threads)
                assert result.success, failures(result)
                m = meta_of(result, "hidden_states")
                figures[f"extract_{name}"] = {"wall_s": round(wall, 1), "job_s": m["slurm_elapsed_s"], "tokens": m["tokens"],
                                              "tokens_per_s_job": round(m["tokens"] / max(1, m["slurm_elapsed_s"]), 1),
                                              "tokens_per_s_extracting": round(float(m["tokens_per_s"]), 1)}
                print(f"extraction, {name}: {figures[f'extract_{name}']}", flush=True)
                shutil.copytree(out, Path(tmp) / f"states-{name}")
            figures["extract_max_abs_diff"] = states_diff(Path(tmp) / "states-one_node", Path(tmp) / "states-two_nodes")
            print(f"extraction, largest state difference one vs two nodes: {figures['extract_max_abs_diff']:.3g}")

            train = {"launcher": "slurm", "threads": 1, "nproc_per_node": 1}
            drafter = layout.drafter_dir("demo")
            for name, conf, shape in (("one_node", one.conf, {"tasks_per_node": 2}), ("two_nodes", two.conf, {"nodes": 2})):
                shutil.rmtree(drafter, ignore_errors=True)
                result, wall = launch(instance, "drafter_checkpoint", "demo", {**train, "slurm": shape}, conf, 1)
                assert result.success, failures(result)
                m = meta_of(result, "drafter_checkpoint")
                figures[f"train_{name}"] = {"wall_s": round(wall, 1), "job_s": m["slurm_elapsed_s"], "steps": m["steps"],
                                            "tokens_per_s": round(float(m["tokens_per_s"]), 1)}
                print(f"training, {name}: {figures[f'train_{name}']}", flush=True)
                shutil.copytree(drafter, Path(tmp) / f"drafter-{name}")
            figures["train_max_abs_weight_diff"] = weights_diff(Path(tmp) / "drafter-one_node", Path(tmp) / "drafter-two_nodes")
            print(f"training, largest weight difference one vs two nodes: {figures['train_max_abs_weight_diff']:.3g}")

            shutil.rmtree(drafter)
            marks: dict = {}
            watcher = kill_when(two, "checkpoints/latest", drafter, marks)
            result, _ = launch(instance, "drafter_checkpoint", "demo", {**train, "slurm": {"nodes": 2}}, two.conf, 1)
            failed_at = time.monotonic()
            watcher.join(60)
            assert not result.success and "killed_at" in marks
            figures["node_death_to_run_failure_s"] = round(failed_at - marks["killed_at"], 1)
            print(f"training, node 2 killed: the run failed {figures['node_death_to_run_failure_s']} s later: "
                  f"{failures(result)[0].splitlines()[0]}", flush=True)
            two.restart_node(1)

            shutil.rmtree(out)
            marks = {}
            watcher = kill_when(two, "parts/2-1/shard-*.safetensors", out, marks)
            result, _ = launch(instance, "hidden_states", "bench", {**extract, "slurm": {"nodes": 2}}, two.conf, 1)
            watcher.join(60)
            assert not result.success
            kept = len(set(stored_in_files(out)))
            two.restart_node(1)
            result, _ = launch(instance, "hidden_states", "bench", {**extract, "slurm": {"nodes": 2}}, two.conf, 1)
            assert result.success, failures(result)
            m = meta_of(result, "hidden_states")
            figures["extract_after_node_death"] = {"samples": m["samples_planned"], "kept_in_shards": kept,
                                                   "redone": m["extracted_now"], "stored": len(stored_in_files(out))}
            print(f"extraction, node 2 killed after its first shard: {figures['extract_after_node_death']}", flush=True)
    record("slurm_two_nodes", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
