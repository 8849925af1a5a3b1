"""kill -9 of the trainer, of a producer, and of both, at several points of a streamed run.

Real processes (``python -m eagle3_assets.drafter.training`` and ``python -m
eagle3_assets.hidden_states.spool``) over a spool whose cap is barely above the least the
preflight accepts, so producers pause and, after a kill, make room for the unit the trainer
needs. Kill points are read from the files the processes write (the cursor's step, the
captures journal, the lease files). Afterwards the count comes from the trainer's own step
records in its checkpoint and from the corpus parquet: every sample trained exactly once per
epoch (0 twice, 0 skipped); the captures journal holds every trained sample; the spool's
units, leases and temporary folders are empty; the spool's bytes, sampled from the
filesystem during the run, never exceeded the cap.
"""

import json
from collections import Counter

import polars as pl
import pytest

from eagle3_assets.drafter.training.checkpoints import latest_checkpoint, load_checkpoint
from eagle3_assets.hidden_states.spool.plan import build_plan, write_plan
from eagle3_assets.hidden_states.spool.preflight import stream_preflight
from tests.support.streaming import (
    Sampler,
    captured_units,
    cursor_step,
    make_corpus,
    producer_job,
    spawn_producer,
    spawn_trainer,
    stream_settings,
    train_job,
    training,
    wait_for,
)

pytestmark = pytest.mark.model
STEPS = 8  # two epochs of 12 samples in batches of 3


def _leased(spool) -> bool:
    return any((spool / "leases").glob("*.json"))


class Run:
    def __init__(self, tmp_path, model_dir):
        self.tmp, self.spool = tmp_path, tmp_path / "spool"
        self.corpus = make_corpus(tmp_path / "corpus.parquet")
        settings = training(epochs=2.0)
        probe = stream_settings(self.spool, self.corpus)
        plan = write_plan(self.spool, build_plan(probe, seed=0, batch_size=3, world=1, total_steps=STEPS, hidden_size=576,
                                                 max_length=64))
        floor = stream_preflight(plan, spool_dir=self.spool)["min_cap_bytes"]
        (self.spool / "plan.json").unlink()
        self.stream = stream_settings(self.spool, self.corpus, cap_bytes=floor + 150_000)
        self.job = train_job(model_dir, tmp_path / "train", stream=self.stream, settings=settings).write(tmp_path / "train.json")
        self.pjob = tmp_path / "producer.json"
        self.pjob.write_text(producer_job(self.spool, model_dir).model_dump_json())
        self.sampler = Sampler(self.spool)
        self.trainer = self.producer = None
        self.kills: list[str] = []
        self.launches = Counter()

    def start(self, who: str):
        self.launches[who] += 1
        if who == "trainer":
            self.trainer = spawn_trainer(self.job, self.tmp / "trainer.log")
        else:
            self.producer = spawn_producer(self.pjob, self.tmp / "producer.log")

    def kill(self, who: str, when, what: str):
        procs = [p for p in (self.trainer, self.producer) if p is not None]
        wait_for(when, 240, what, procs)
        proc = self.trainer if who == "trainer" else self.producer
        assert proc.poll() is None, f"{who} ended before the kill point ({what})"
        proc.kill()  # SIGKILL
        proc.wait()
        self.kills.append(f"{who} at {what}")

    def finish(self):
        try:
            assert self.trainer.wait(240) == 0, (self.tmp / "trainer.log").read_text()[-4000:]
            assert self.producer.wait(60) == 0, (self.tmp / "producer.log").read_text()[-4000:]
        finally:
            for p in (self.trainer, self.producer):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait()
            peak = self.sampler.stop()
        return self.count(peak)

    def count(self, peak: int) -> dict:
        corpus_ids = pl.read_parquet(self.corpus).filter(pl.col("split") == "train")["sample_id"].to_list()
        state = load_checkpoint(latest_checkpoint(self.tmp / "train"))
        assert state["step"] == STEPS and len(state["metrics"]) == STEPS
        per_epoch: dict[int, Counter] = {}
        for m in state["metrics"]:  # the trainer's own step records, as the checkpoint holds them
            per_epoch.setdefault(m["epoch"], Counter()).update(k.split(":", 1)[1] for k in m["consumed"]["ids"])
        twice = sum(c - 1 for ep in per_epoch.values() for c in ep.values() if c > 1)
        skipped = sum(1 for ep in per_epoch.values() for s in corpus_ids if s not in ep)
        assert sorted(per_epoch) == [0, 1]
        captured = captured_units(self.spool)
        for epoch in per_epoch:
            done = {s for c in captured if c["unit"].startswith(f"e{epoch:04d}-") for s in c["samples"]}
            assert set(per_epoch[epoch]) <= done, f"epoch {epoch}: trained a sample no producer published"
        leftover = [p for d in ("units", "leases", "tmp") for p in (self.spool / d).iterdir()]
        figures = {"kills": self.kills, "twice": twice, "skipped": skipped, "peak": peak, "cap": self.stream.cap_bytes,
                   "captures": len(captured), "units": len(json.loads((self.spool / "plan.json").read_text())["units"]),
                   "leftover": [str(p) for p in leftover], "samples": self.sampler.samples}
        print(json.dumps(figures))
        assert (twice, skipped, leftover) == (0, 0, []), figures
        assert peak <= self.stream.cap_bytes, figures
        return figures


def test_kill_the_trainer_twice(tmp_path, model_dir):
    run = Run(tmp_path, model_dir)
    run.start("producer")
    run.start("trainer")
    run.kill("trainer", lambda: cursor_step(run.spool) >= 4, "step 4 (after the checkpoint of step 3)")
    run.start("trainer")
    run.kill("trainer", lambda: cursor_step(run.spool) >= 7, "step 7 (after the checkpoint of step 6)")
    run.start("trainer")
    figures = run.finish()
    assert figures["captures"] > figures["units"]  # units consumed after the checkpoint were captured again


def test_kill_the_producer_mid_capture_twice(tmp_path, model_dir):
    run = Run(tmp_path, model_dir)
    run.start("producer")
    run.start("trainer")
    run.kill("producer", lambda: len(captured_units(run.spool)) >= 2 and _leased(run.spool), "a capture after 2 published")
    run.start("producer")
    run.kill("producer", lambda: len(captured_units(run.spool)) >= 9 and _leased(run.spool), "a capture after 9 published")
    run.start("producer")
    run.finish()


def test_kill_both_twice(tmp_path, model_dir):
    run = Run(tmp_path, model_dir)
    run.start("producer")
    run.start("trainer")
    run.kill("producer", lambda: cursor_step(run.spool) >= 2 and _leased(run.spool), "step 2 with a capture running")
    run.kill("trainer", lambda: True, "step 2 (right after the producer)")
    run.start("trainer")
    run.start("producer")
    run.kill("trainer", lambda: cursor_step(run.spool) >= 5, "step 5")
    run.kill("producer", lambda: True, "step 5 (right after the trainer)")
    run.start("producer")
    run.start("trainer")
    run.finish()
