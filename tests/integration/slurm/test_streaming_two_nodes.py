"""The streaming mode in the field's layout, on the two-node SLURM of this machine
(``tests.support.slurm_two_nodes``: two network namespaces, each a host with its own slurmd).

One ``drafter_checkpoint`` materialization with ``launcher: slurm`` and a byte cap starts the
producer through the launcher as a SLURM job of its own and the trainer as another; both ask for
a whole node (``--exclusive``), so capture runs on one node and training on the other, over the
spool under the data root, which both nodes share. Mid-run, once the trainer has checkpointed,
the trainer's node is lost (its slurmd and every process of its namespace killed at once): the
step fails with SLURM's state, the producer's job is cancelled. The node comes back and the next
materialization resumes from the checkpoint. Counted afterwards from the trainer's own step
records (the final checkpoint) and the producers' captures journal, against the corpus parquet:
each sample trained once per epoch (0 twice, 0 skipped), every trained sample published by a
producer, the spool's units, leases and temporary folders empty, and its bytes, sampled from the
filesystem here every 10 ms across both runs, never above the cap.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import Counter

import dagster as dg
import polars as pl
import pytest

from eagle3_assets.slurm import scheduler
from tests.conftest import small_prompts, write_jsonl
from tests.integration.slurm.test_slurm import DATASET, RECIPE, TEST_RECIPE, _checkpoint, _failures, _materialize
from tests.integration.slurm.test_slurm_two_nodes import two_nodes  # noqa: F401  (the module's cluster)
from tests.support.streaming import Sampler, captured_units, cursor_step

pytestmark = [pytest.mark.slurm, pytest.mark.model]

EPOCHS = 2  # of the training split, in batches of 2
CAP = 3_000_000
TRAINER = f"eagle3-drafter_checkpoint-{RECIPE}"
PRODUCER = f"eagle3-stream-producer-{RECIPE}-0"
STREAM_ON_TWO_NODES = {
    "launcher": "slurm", "threads": 1, "nproc_per_node": 1,
    "slurm": {"nodes": 1, "sbatch_options": ["--exclusive"]},  # the trainer: a node of its own
    "stream": {"slurm": {"sbatch_options": ["--exclusive"]},  # the producer: the other node
               "cap_bytes": CAP, "unit_bytes": 300_000, "stale_s": 5.0, "producer_restarts": 1},
}


@contextlib.contextmanager
def corpus_root(tmp_path_factory):
    """A data root with one dataset of 16 prompts, a quarter held out; the recipe trains ``EPOCHS`` epochs."""
    from eagle3_assets.paths import DataLayout
    from eagle3_assets.resources import DatasetSettings
    from tests.support.dagster_helpers import run_dataset

    layout = DataLayout(tmp_path_factory.mktemp("stream2") / "data")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EAGLE3_HOME", str(layout.root))
        mp.setenv("OMP_NUM_THREADS", "1")  # forwarded to the jobs
        write_jsonl(layout.prompt_source(DATASET), small_prompts(16))
        (layout.root / "recipes").mkdir(parents=True)
        (layout.root / "recipes" / f"{RECIPE}.toml").write_text(TEST_RECIPE.replace("max_steps = 16", f"epochs = {EPOCHS}"))
        with dg.instance_for_test() as instance:
            assert run_dataset(instance, DATASET, resources={"dataset_settings": DatasetSettings(eval_fraction=0.25)}).success
            yield layout, instance


def _node_of(name: str) -> str:
    [job] = scheduler.live_jobs_named(name)
    return job.nodes


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def count(layout, spool, out, kept) -> dict:
    """Each sample once per epoch, from the final checkpoint's step records against the corpus
    parquet; every trained sample published (captures journal); the spool's folders empty."""
    corpus_ids = pl.read_parquet(layout.corpus(DATASET)).filter(pl.col("split") == "train")["sample_id"].to_list()
    final, plan = _checkpoint(out), json.loads((spool / "plan.json").read_text())
    assert final["step"] == plan["total_steps"]
    if kept is not None:
        assert kept["step"] < final["step"] and final["metrics"][: kept["step"]] == kept["metrics"]
    per_epoch: dict[int, Counter] = {}
    for m in final["metrics"]:
        per_epoch.setdefault(m["epoch"], Counter()).update(k.split(":", 1)[1] for k in m["consumed"]["ids"])
    twice = sum(c - 1 for ep in per_epoch.values() for c in ep.values() if c > 1)
    skipped = sum(1 for ep in per_epoch.values() for s in corpus_ids if s not in ep)
    captured = captured_units(spool)
    for epoch, trained in per_epoch.items():
        published = {s for c in captured if c["unit"].startswith(f"e{epoch:04d}-") for s in c["samples"]}
        assert set(trained) <= published, f"epoch {epoch}: trained a sample no producer published"
    leftover = [str(p) for d in ("units", "leases", "tmp") for p in (spool / d).iterdir()]
    figures = {"steps": final["step"], "epochs": len(per_epoch), "train_samples": len(corpus_ids), "twice": twice,
               "skipped": skipped, "leftover": leftover, "captures": len(captured), "units": len(plan["units"])}
    assert len(corpus_ids) >= 6 and sorted(per_epoch) == list(range(EPOCHS)), figures
    assert (twice, skipped, leftover) == (0, 0, []), figures
    assert (spool / "done.json").exists()
    return figures


def ran_on(log: str) -> str:
    """The node a job ran on, from its log's first line (the batch script's)."""
    return log.split("node(s) [", 1)[1].split("]", 1)[0]


def test_capture_on_one_node_training_on_the_other_a_lost_node_and_a_relaunch(two_nodes, model_dir,  # noqa: F811
                                                                              tmp_path_factory):
    with corpus_root(tmp_path_factory) as (layout, instance):
        spool, out = layout.root / "spool" / RECIPE, layout.drafter_dir(RECIPE)
        sampler = Sampler(spool)
        seen: dict = {}

        def lose_the_trainers_node():
            try:
                _wait(lambda: (out / "checkpoints" / "latest").exists() and cursor_step(spool) >= 3, 600,
                      "the trainer past its first checkpoint")
                seen["trainer"], seen["producer"] = _node_of(TRAINER), _node_of(PRODUCER)
                seen["step"], seen["at"] = cursor_step(spool), time.monotonic()
                two_nodes.kill_node(two_nodes.nodes.index(seen["trainer"]))
            except BaseException as exc:  # shown by the assertions below
                seen["error"] = repr(exc)

        watcher = threading.Thread(target=lose_the_trainers_node, daemon=True)
        watcher.start()
        t0 = time.monotonic()
        first = _materialize(instance, "drafter_checkpoint", RECIPE, STREAM_ON_TWO_NODES)
        failed_after = time.monotonic() - seen.get("at", t0)
        watcher.join(30)
        assert "error" not in seen and "at" in seen, (seen, _failures(first))
        assert seen["trainer"] != seen["producer"]  # capture on one node, training on the other
        assert not first.success
        [message] = _failures(first)
        assert "state NODE_FAIL" in message and f"on {seen['trainer']}" in message, message
        kept = _checkpoint(out)
        assert 2 <= kept["step"]
        assert not scheduler.live_jobs_named(PRODUCER)  # the failed step cancelled its producer

        two_nodes.restart_node(two_nodes.nodes.index(seen["trainer"]))
        second = _materialize(instance, "drafter_checkpoint", RECIPE, STREAM_ON_TWO_NODES)
        total_s = time.monotonic() - t0
        peak = sampler.stop()
        assert second.success, _failures(second)
        meta = {k: v.value for k, v in second.asset_materializations_for_node("drafter_checkpoint")[0].metadata.items()}

        # where each side ran, from the jobs' own logs (the batch script's first line names its node)
        trainer_log = open(meta["slurm_log"]).read()
        producer_logs = sorted((out / "stream" / "producer-0").glob("slurm-*.out"))
        assert len(producer_logs) == 2
        second_producer = producer_logs[-1].read_text()
        assert ran_on(trainer_log) != ran_on(second_producer), (ran_on(trainer_log), ran_on(second_producer))
        assert "producer done: " in second_producer

        figures = {"nodes": {"trainer": seen["trainer"], "producer": seen["producer"]}, "killed_at_step": seen["step"],
                   "checkpoint_kept": kept["step"], "failed_after_s": round(failed_after, 1),
                   **count(layout, spool, out, kept), "peak": peak, "cap": CAP, "sampled": sampler.samples,
                   "total_s": round(total_s, 1)}
        print(json.dumps(figures))
        assert 0 < peak <= CAP and meta["stream_peak_spool_bytes"] <= CAP, figures


def test_a_lost_producer_node_is_replaced_by_a_new_producer_job_and_the_run_finishes(two_nodes, model_dir,  # noqa: F811
                                                                                   tmp_path_factory):
    """The producer's node lost mid-run: its job ends (NODE_FAIL), the step submits a new producer
    job, which waits in the queue (the trainer holds the other node) until the node is back; the
    trainer waits for units meanwhile, and the one materialization finishes the run."""
    with corpus_root(tmp_path_factory) as (layout, instance):
        spool, out = layout.root / "spool" / RECIPE, layout.drafter_dir(RECIPE)
        sampler = Sampler(spool)
        seen: dict = {}

        def lose_the_producers_node_and_bring_it_back():
            try:
                _wait(lambda: cursor_step(spool) >= 3, 600, "the trainer past step 3")
                seen["trainer"], seen["producer"] = _node_of(TRAINER), _node_of(PRODUCER)
                [job] = scheduler.live_jobs_named(PRODUCER)
                seen["step"], seen["at"], seen["job"] = cursor_step(spool), time.monotonic(), job.job_id
                lost = two_nodes.nodes.index(seen["producer"])
                two_nodes.kill_node(lost)
                _wait(lambda: any(j.job_id != seen["job"] for j in scheduler.live_jobs_named(PRODUCER)), 300,
                      "a new producer job")
                seen["replaced_after_s"] = round(time.monotonic() - seen["at"], 1)
                seen["replaced_state"] = scheduler.live_jobs_named(PRODUCER)[0].state
                seen["step_meanwhile"] = cursor_step(spool)
                two_nodes.restart_node(lost)
            except BaseException as exc:  # shown by the assertions below
                seen["error"] = repr(exc)

        watcher = threading.Thread(target=lose_the_producers_node_and_bring_it_back, daemon=True)
        watcher.start()
        t0 = time.monotonic()
        result = _materialize(instance, "drafter_checkpoint", RECIPE, STREAM_ON_TWO_NODES)
        total_s = time.monotonic() - t0
        peak = sampler.stop()
        watcher.join(30)
        assert "error" not in seen and "at" in seen, (seen, _failures(result))
        assert seen["trainer"] != seen["producer"]
        assert result.success, _failures(result)
        meta = {k: v.value for k, v in result.asset_materializations_for_node("drafter_checkpoint")[0].metadata.items()}
        assert meta["stream_producer_restarts"] == 1 and meta["slurm_state"] == "COMPLETED"
        assert scheduler.final_record(seen["job"]).state == "NODE_FAIL"  # the scheduler's own word on the lost job
        producer_logs = sorted((out / "stream" / "producer-0").glob("slurm-*.out"), key=lambda p: int(p.stem.split("-")[1]))
        assert len(producer_logs) == 2 and "producer done: " in producer_logs[-1].read_text()
        assert ran_on(open(meta["slurm_log"]).read()) == seen["trainer"]  # the trainer was never touched
        figures = {"nodes": {"trainer": seen["trainer"], "producer": seen["producer"]}, "killed_at_step": seen["step"],
                   "replaced_after_s": seen["replaced_after_s"], "replacement": seen["replaced_state"],
                   "step_when_replaced": seen["step_meanwhile"], **count(layout, spool, out, None), "peak": peak,
                   "cap": CAP, "sampled": sampler.samples, "trainer_wait_s": meta["stream_trainer_wait_s"],
                   "total_s": round(total_s, 1)}
        print(json.dumps(figures))
        assert 0 < peak <= CAP and meta["stream_peak_spool_bytes"] <= CAP, figures
