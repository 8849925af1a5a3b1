"""The streaming mode in the field's layout, on the two-node SLURM of this machine
(``tests.support.slurm_two_nodes``: two network namespaces, each a host with its own slurmd).

The dataset (16 prompts through ``merged_corpus`` with the real model) is built once for the
module; each test works on a copy of that data root with its own Dagster instance, so neither
sees the other's spool, checkpoints or runs.

One ``drafter_checkpoint`` materialization with ``launcher: slurm`` and a byte cap starts each
producer through the launcher as a SLURM job of its own and the trainer as another, over the
spool under the data root, which both nodes share.

- The trainer's node lost: producer and trainer each ask for a whole node (``--exclusive``); once
  the trainer has checkpointed, its node is killed (its slurmd and every process of its namespace
  at once): the step fails with SLURM's state, the producer's job is cancelled; the node comes back
  and the next materialization resumes from the checkpoint.
- Two producers on two nodes and a cross-host lease takeover: ``stream.producers: 2``, each
  producer's job asking for 60 % of a node's memory (two cannot share one), the trainer's for one
  CPU and 1 GB (it fits beside one). While the producer on the node without the trainer holds a
  lease, that node is killed: its lease file stays on disk (nothing could drop it), the producer
  on the other host reclaims it once its heartbeat is ``stale_s`` old and publishes that unit; the
  lost producer's job ends NODE_FAIL and a replacement is submitted, which stays queued (its node
  is down, the other is full) and is stopped at once when the run is done.

Counted afterwards from the trainer's own step records (the final checkpoint) and the producers'
captures journal, against the corpus parquet: each sample trained once per epoch (0 twice, 0
skipped), every trained sample published by a producer, the spool's units, leases and temporary
folders empty, and its bytes, sampled from the filesystem here every 10 ms, never above the cap.
"""

from __future__ import annotations

import contextlib
import json
import shutil
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


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A data root built once for the module: one dataset of 16 prompts through ``merged_corpus``
    (a quarter held out); the recipe trains ``EPOCHS`` epochs. Tests copy it (:func:`corpus_root`)."""
    from eagle3_assets.paths import DataLayout
    from eagle3_assets.resources import DatasetSettings
    from tests.support.dagster_helpers import run_dataset

    layout = DataLayout(tmp_path_factory.mktemp("stream2-corpus") / "data")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EAGLE3_HOME", str(layout.root))
        write_jsonl(layout.prompt_source(DATASET), small_prompts(16))
        (layout.root / "recipes").mkdir(parents=True)
        (layout.root / "recipes" / f"{RECIPE}.toml").write_text(TEST_RECIPE.replace("max_steps = 16", f"epochs = {EPOCHS}"))
        with dg.instance_for_test() as instance:
            assert run_dataset(instance, DATASET, resources={"dataset_settings": DatasetSettings(eval_fraction=0.25)}).success
    return layout.root


@contextlib.contextmanager
def corpus_root(corpus, tmp_path_factory):
    """A test's own copy of the module's data root, with its own ``EAGLE3_HOME`` and Dagster instance."""
    from eagle3_assets.paths import DataLayout

    layout = DataLayout(tmp_path_factory.mktemp("stream2") / "data")
    shutil.copytree(corpus, layout.root, symlinks=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EAGLE3_HOME", str(layout.root))
        mp.setenv("OMP_NUM_THREADS", "1")  # forwarded to the jobs
        with dg.instance_for_test() as instance:
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
                                                                              corpus, tmp_path_factory):
    with corpus_root(corpus, tmp_path_factory) as (layout, instance):
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


STALE_S = 60.0  # the default; SLURM marks the lost node down (SlurmdTimeout 30 s) before that
PRODUCERS = [f"eagle3-stream-producer-{RECIPE}-{i}" for i in range(2)]


def two_producers(node_mb: int) -> dict:
    """Two producers, each a job of 60 % of a node's memory (two cannot share a node); the trainer's
    job of one CPU and 2 GB fits beside one of them."""
    return {"launcher": "slurm", "threads": 1, "nproc_per_node": 1,
            "slurm": {"nodes": 1, "cpus_per_task": 1, "mem": "2G"},
            "stream": {"producers": 2, "slurm": {"mem": f"{int(node_mb * 0.6)}M"}, "cap_bytes": CAP,
                       "unit_bytes": 300_000, "stale_s": STALE_S, "producer_restarts": 1}}


def node_memory_mb(two_nodes, node: str) -> int:  # noqa: F811
    """The node's memory as the scheduler schedules it (``RealMemory``)."""
    out = two_nodes.run("scontrol", "show", "node", node, "-o").stdout
    return int(out.split("RealMemory=", 1)[1].split()[0])


def leases_of(spool, host: str) -> list[dict]:
    """The lease files in ``spool/leases`` whose JSON names ``host`` (with each file's mtime: its heartbeat)."""
    held = []
    for path in sorted((spool / "leases").glob("*.json")):
        try:
            lease, mtime = json.loads(path.read_text()), path.stat().st_mtime
        except (OSError, ValueError):  # gone meanwhile, or being written
            continue
        if lease.get("host") == host:
            held.append({**lease, "mtime": mtime, "path": path})
    return held


def _lease_host(path) -> str | None:
    try:
        return json.loads(path.read_text()).get("host")
    except (OSError, ValueError):
        return None


def test_two_producers_on_two_nodes_and_a_lost_producers_lease_taken_over_by_the_other_host(two_nodes, model_dir,  # noqa: F811
                                                                                        corpus, tmp_path_factory):
    with corpus_root(corpus, tmp_path_factory) as (layout, instance):
        spool, out = layout.root / "spool" / RECIPE, layout.drafter_dir(RECIPE)
        config = two_producers(min(node_memory_mb(two_nodes, n) for n in two_nodes.nodes))
        sampler = Sampler(spool)
        seen: dict = {}

        def lose_the_node_of_the_producer_beside_no_trainer():
            try:
                _wait(lambda: all(j.state == "RUNNING" for n in (TRAINER, *PRODUCERS) for j in scheduler.live_jobs_named(n))
                      and all(scheduler.live_jobs_named(n) for n in (TRAINER, *PRODUCERS)), 600,
                      "the trainer and both producers running")
                nodes = {n: _node_of(n) for n in (TRAINER, *PRODUCERS)}
                [victim] = [i for i, n in enumerate(PRODUCERS) if nodes[n] != nodes[TRAINER]]
                lost = nodes[PRODUCERS[victim]]
                seen.update(nodes=nodes, victim=victim, lost=lost, job=scheduler.live_jobs_named(PRODUCERS[victim])[0].job_id)
                _wait(lambda: leases_of(spool, lost), 600, f"a lease held on {lost}")
                two_nodes.kill_node(two_nodes.nodes.index(lost))
                seen["at"], seen["at_wall"] = time.monotonic(), time.time()
                held = leases_of(spool, lost)  # read after the kill: nothing on that host could drop it
                seen["held"] = [{k: v for k, v in h.items() if k != "path"} for h in held]
                lease = held[0]
                seen["unit"] = lease["unit"]
                deadline = seen["at"] + 300
                while "published" not in seen or "replacement" not in seen:  # from the filesystem and the queue:
                    if "reclaimed_after_s" not in seen and _lease_host(lease["path"]) != lost:  # the dead lease replaced or gone
                        seen["reclaimed_after_s"] = round(time.monotonic() - seen["at"], 2)
                        seen["heartbeat_age_at_reclaim_s"] = round(time.time() - lease["mtime"], 2)
                    published = [c for c in captured_units(spool) if c["unit"] == lease["unit"]]
                    if published and "published" not in seen:  # its unit published
                        seen["published"], seen["published_after_s"] = published, round(time.monotonic() - seen["at"], 2)
                    again = [j for j in scheduler.live_jobs_named(PRODUCERS[victim]) if j.job_id != seen["job"]]
                    if again and "replacement" not in seen:  # a new job for the lost producer
                        seen.update(replaced_after_s=round(time.monotonic() - seen["at"], 1), replacement=again[0].job_id,
                                    replacement_state=f"{again[0].state} ({again[0].reason})")
                    if time.monotonic() > deadline:
                        raise AssertionError(f"300 s after the kill: unit {lease['unit']} published: {'published' in seen}, "
                                             f"a replacement job: {'replacement' in seen}")
                    time.sleep(0.05)
            except BaseException as exc:  # shown by the assertions below
                seen["error"] = repr(exc)

        watcher = threading.Thread(target=lose_the_node_of_the_producer_beside_no_trainer, daemon=True)
        watcher.start()
        t0 = time.monotonic()
        result = _materialize(instance, "drafter_checkpoint", RECIPE, config)
        total_s = time.monotonic() - t0
        peak = sampler.stop()
        watcher.join(30)
        assert "error" not in seen and "replacement" in seen, (json.dumps(seen, default=str), _failures(result))
        lost, victim = seen["lost"], seen["victim"]
        survivor = 1 - victim
        nodes = seen["nodes"]
        assert nodes[PRODUCERS[0]] != nodes[PRODUCERS[1]] and nodes[TRAINER] == nodes[PRODUCERS[survivor]], nodes
        assert result.success, _failures(result)  # one materialization, despite the lost node

        # the lost producer's lease outlived it; the other host reclaimed it only once its heartbeat was stale
        [held] = seen["held"]
        assert held["host"] == lost and held["producer"] == f"producer-{victim}", held
        assert seen["heartbeat_age_at_reclaim_s"] >= STALE_S, seen
        [published] = seen["published"]  # published once, by the producer on the other host
        assert published["producer"] == f"producer-{survivor}", published

        # the scheduler's own word: the lost job ended NODE_FAIL, a replacement was submitted and has ended
        meta = {k: v.value for k, v in result.asset_materializations_for_node("drafter_checkpoint")[0].metadata.items()}
        assert meta["stream_producer_restarts"] == 1 and meta["slurm_state"] == "COMPLETED"
        assert scheduler.final_record(seen["job"]).state == "NODE_FAIL"
        assert not any(scheduler.live_jobs_named(n) for n in PRODUCERS)  # nothing left queued or running
        replacement_end = scheduler.final_record(seen["replacement"]).state
        replacement_log = out / "stream" / f"producer-{victim}" / f"slurm-{seen['replacement']}.out"
        if replacement_end == "CANCELLED":  # still queued when the run was done: stopped at once, never ran
            assert not replacement_log.exists()
        else:  # it found room once the other producer had ended, started and saw the run done
            assert replacement_end == "COMPLETED" and "producer done: " in replacement_log.read_text(), replacement_end
        # once the run was done, every producer job ended within seconds (the scheduler's end times,
        # 1 s grain, against done.json's mtime): none waited on a queued job or loaded a model for nothing
        done_at = (spool / "done.json").stat().st_mtime
        ends = [scheduler.timestamp(scheduler.scontrol_job(j)["EndTime"]).timestamp()
                for j in (_first_job(out, survivor), seen["replacement"])]
        producers_end_after_done_s = max(ends) - done_at
        assert ran_on(open(meta["slurm_log"]).read()) == nodes[TRAINER]
        for i in range(2):  # where each producer ran, from its first job's log
            first_log = out / "stream" / f"producer-{i}" / f"slurm-{seen['job'] if i == victim else _first_job(out, i)}.out"
            assert ran_on(first_log.read_text()) == nodes[PRODUCERS[i]]
        two_nodes.restart_node(two_nodes.nodes.index(lost))

        by_producer = Counter(c["producer"] for c in captured_units(spool))
        figures = {"nodes": {"trainer": nodes[TRAINER], "producer-0": nodes[PRODUCERS[0]],
                             "producer-1": nodes[PRODUCERS[1]]}, "lost": f"producer-{victim} on {lost}",
                   "lease_taken_over": seen["unit"], "stale_s": STALE_S,
                   "reclaimed_after_kill_s": seen["reclaimed_after_s"],
                   "heartbeat_age_at_reclaim_s": seen["heartbeat_age_at_reclaim_s"],
                   "published_after_kill_s": seen["published_after_s"], "captures_by_producer": dict(by_producer),
                   "replaced_after_kill_s": seen["replaced_after_s"], "replacement_at_submission": seen["replacement_state"],
                   "replacement_end": replacement_end, "producers_end_after_done_s": round(producers_end_after_done_s, 1),
                   **count(layout, spool, out, None), "peak": peak, "cap": CAP, "sampled": sampler.samples,
                   "trainer_wait_s": meta["stream_trainer_wait_s"], "total_s": round(total_s, 1)}
        print(json.dumps(figures))
        assert 0 < peak <= CAP and meta["stream_peak_spool_bytes"] <= CAP, figures
        assert producers_end_after_done_s < 30, figures  # no wait on a producer job still queued (up to 120 s before)


def _first_job(out, i: int) -> str:
    """The job id of producer ``i``'s first log (the lowest)."""
    return str(min(int(p.stem.split("-")[1]) for p in (out / "stream" / f"producer-{i}").glob("slurm-*.out")))
