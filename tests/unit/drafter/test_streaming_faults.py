"""Streaming under faults, unit-level (a stand-in capture engine, hidden size 8, no model): the
offline loader's order on mixed corpora; a cap refused before any plan is written (too small,
or above the spool's filesystem: a real small tmpfs); a disk that fills under a producer stops
the trainer at once with the path; a unit rotten on disk is captured again, never trained on;
the layers record outlives a rerun; the step's restarts, preflight and capture counts.

Equality with a real model is in test_streaming.py; kills in tests/integration/pipeline/test_streaming_kills.py.
"""

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eagle3_assets.drafter.training.data import ShardBatches, ShardDataset
from eagle3_assets.drafter.training.stream import StreamFailed, open_stream
from eagle3_assets.files import InsufficientDiskSpace
from eagle3_assets.hidden_states.extract import extract_corpus
from eagle3_assets.hidden_states.spool.plan import train_entries
from eagle3_assets.hidden_states.spool.preflight import CapTooSmall
from eagle3_assets.hidden_states.spool.produce import Producer
from eagle3_assets.hidden_states.spool.settings import StreamSettings
from eagle3_assets.hidden_states.spool.store import Spool
from tests.support.small_fs import fill, small_filesystem
from tests.support.streaming import LAYER_IDS, EchoCapture, make_mixed_corpora, producer_job, training

ECHO = {"num_hidden_layers": 30, "hidden_size": EchoCapture.hidden_size}


def settings_for(spool: Path, corpora: dict, weights: dict | None = None, **kw) -> StreamSettings:
    weights = weights or {}
    base = dict(spool_dir=str(spool), corpora={str(p): weights.get(n, 1.0) for n, p in corpora.items()}, cap_bytes=8 << 20,
                unit_bytes=80_000, layer_ids=LAYER_IDS, batch_tokens=4096, poll_s=0.01)
    return StreamSettings(**{**base, **kw})


def echo_producer(spool: Path, plan, name="p0") -> Producer:
    return Producer(producer_job(spool, Path("unused"), name=name), EchoCapture(), plan)


def expected_states(ids):
    """What EchoCapture computes for ``ids``, stored as bf16 and read back."""
    [f] = EchoCapture().extract([ids])
    return f.aux.to(torch.bfloat16), f.last.to(torch.bfloat16)


def test_the_plan_takes_the_offline_loaders_order_on_two_corpora_of_mixed_lengths(tmp_path):
    """Shards as extraction writes them (longest first, several rows a forward) and the corpus rows
    (no order of length, ties, ids not in row order): the same entries, so the same batches."""
    corpora = make_mixed_corpora(tmp_path / "corpus")
    shards = {name: tmp_path / "hs" / name for name in corpora}
    for name, corpus in corpora.items():
        extract_corpus(corpus, shards[name], EchoCapture(), batch_tokens=4096, background_writes=False)
    weights = {"a": 1.0, "b": 1.5}
    offline = ShardDataset({str(shards[n]): w for n, w in weights.items()}, max_length=64, seed=2)
    _, entries, _ = train_entries({str(corpora[n]): w for n, w in weights.items()}, seed=2)
    assert entries == offline.entries
    settings = settings_for(tmp_path / "spool", corpora, weights, cap_bytes=1 << 30)
    _, plan, data = open_stream(settings, training(batch_size=4, epochs=2.0, seed=2), rank=0, world=1, target_config=ECHO)
    data.close()
    batches = ShardBatches(offline, 4, seed=2)
    steps = iter(plan.steps())
    for epoch in range(2):
        for batch in batches.epoch(epoch):
            lo, hi = next(steps)
            assert batch["keys"] == [plan.key(p) for p in range(lo, hi)]


def test_a_refused_cap_writes_no_plan_and_a_workable_one_then_runs(tmp_path):
    corpora = make_mixed_corpora(tmp_path / "corpus")
    spool = tmp_path / "spool"
    with pytest.raises(CapTooSmall, match=r"stream\.cap_bytes = 1,000 is below"):
        open_stream(settings_for(spool, corpora, cap_bytes=1000), training(), rank=0, world=1, target_config=ECHO)
    assert not (spool / "plan.json").exists()  # no producer captures for it; nothing holds up the next run
    assert json.loads((spool / "preflight.json").read_text())["cap_bytes"] == 1000  # the step shows what was refused
    _, plan, data = open_stream(settings_for(spool, corpora), training(), rank=0, world=1, target_config=ECHO)
    data.close()
    assert plan.cap_bytes == 8 << 20 and (spool / "plan.json").exists()


@pytest.mark.mount
def test_a_cap_above_the_spools_filesystem_is_refused_naming_the_folder_and_both_figures(tmp_path):
    """The reporter's case: the spool on a 2 MB filesystem, a 40 MB cap."""
    corpora = make_mixed_corpora(tmp_path / "corpus")
    with small_filesystem(tmp_path / "fs", 2 << 20) as fs:
        spool = fs / "spool"
        with pytest.raises(InsufficientDiskSpace) as err:
            open_stream(settings_for(spool, corpora, cap_bytes=40_000_000), training(), rank=0, world=1, target_config=ECHO)
        message = str(err.value)
        assert str(spool) in message and "stream.cap_bytes" in message and "need 40,000,000 bytes" in message
        assert "only 2,0" in message and "free" in message  # the filesystem's free bytes, from statvfs
        assert not (spool / "plan.json").exists()
        _, plan, data = open_stream(settings_for(spool, corpora, cap_bytes=1_500_000), training(), rank=0, world=1,
                                    target_config=ECHO)
        data.close()


class FillsTheDisk(EchoCapture):
    """Another process fills the spool's filesystem while this unit is captured."""

    def __init__(self, folder):
        self.folder = folder

    def extract(self, rows):
        fill(self.folder)
        return super().extract(rows)


@pytest.mark.mount
@pytest.mark.parametrize("when", ["before-capture", "during-capture"])
def test_a_disk_that_fills_under_a_producer_stops_the_trainer_at_once_with_the_path(tmp_path, when):
    """The cap fits the filesystem, then something else fills it: before a unit (the producer's
    check of the unit's bound refuses it) or during one (the write hits ENOSPC). The producer
    records it in the spool and ends; the trainer stops at its next wait with that message,
    instead of waiting on the unit for ever; nothing published is lost."""
    corpora = make_mixed_corpora(tmp_path / "corpus")
    with small_filesystem(tmp_path / "fs", 2 << 20) as fs:
        spool = fs / "spool"
        _, plan, data = open_stream(settings_for(spool, corpora, cap_bytes=1_500_000), training(), rank=0, world=1,
                                    target_config=ECHO)
        producer = echo_producer(spool, plan)
        first = min(plan.units, key=lambda u: u.first_use)
        with Spool(spool).lock():
            unit, lease = producer.choose()
        producer.capture(unit, lease)  # one unit published before the disk fills
        if when == "before-capture":
            fill(fs, leave=8 << 10)
        else:
            producer.extractor = FillsTheDisk(fs)
        errors = []

        def run():
            try:
                producer.run()
            except OSError as exc:
                errors.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(30)
        assert errors and not thread.is_alive()
        t0 = time.monotonic()
        data.wait_timeout_s = 20  # before: the trainer waited for ever (TimeoutError here)
        with pytest.raises(StreamFailed, match=r"cannot go on \(producer p0\): .*(not enough disk|disk full writing)"):
            for _ in data.epoch(0):
                pass
        assert time.monotonic() - t0 < 5
        failed = json.loads((spool / "failed.json").read_text())
        assert failed["by"] == "producer p0" and str(spool / "tmp") in failed["error"]
        assert first.id in Spool(spool).published() and not any((spool / "tmp").iterdir())  # kept; temporary gone
        data.close()


@pytest.mark.parametrize("rot", ["flipped", "truncated"])
def test_a_unit_rotten_on_disk_is_captured_again_never_trained_on(tmp_path, rot):
    """One byte of a published unit's shard changed at the same size (NaN losses before), or the
    shard cut short (every rerun failed the same way before): the trainer's read-back removes it,
    a producer captures it again, and the batch holds the captured states."""
    corpora = make_mixed_corpora(tmp_path / "corpus")
    spool = tmp_path / "spool"
    _, plan, data = open_stream(settings_for(spool, corpora), training(batch_size=4), rank=0, world=1, target_config=ECHO)
    producer = echo_producer(spool, plan)
    with Spool(spool).lock():
        unit, lease = producer.choose()
    producer.capture(unit, lease)
    shard = next((spool / "units" / unit.id).glob("shard-*.safetensors"))
    raw = bytearray(shard.read_bytes())
    if rot == "flipped":  # one byte in the middle of the aux states
        header = int.from_bytes(raw[:8], "little")
        lo, hi = json.loads(raw[8: 8 + header])["aux_hidden"]["data_offsets"]
        raw[8 + header + (lo + hi) // 2] ^= 0x7F
    else:
        raw = raw[: len(raw) // 2]
    shard.write_bytes(bytes(raw))
    thread = threading.Thread(target=producer.run, kwargs={"stop_when_idle": True}, daemon=True)
    thread.start()
    batch = next(data.epoch(0))
    frames = {str(p): p for p in corpora.values()}
    import polars as pl

    rows = {}
    for d, name in enumerate(plan.corpora):
        for sid, ids in pl.read_parquet(frames[name], columns=["sample_id", "input_ids"]).iter_rows():
            rows[f"{d}:{sid}"] = ids
    for i, key in enumerate(batch["keys"]):
        aux, last = expected_states(rows[key])
        n = len(rows[key])
        assert torch.equal(batch["aux_hidden"][i, :n], aux) and torch.equal(batch["last_hidden"][i, :n], last), key
    assert data.rotten == {unit.id: 1}
    data.after_step({"consumed": batch["record"], "step": 1})
    for step, b in enumerate(data.epoch(0, 1), 2):
        data.after_step({"consumed": b["record"], "step": step})
    thread.join(30)
    data.close()


def test_the_layers_record_outlives_a_rerun_of_a_finished_recipe_with_another_cap(tmp_path):
    """drafter_acceptance reads the layers a streamed drafter was trained on; a rerun with another cap
    empties the finished run's spool and, its training done, reads no unit: the record stays."""
    from eagle3_assets.drafter.trained_layers import trained_layers

    corpora = make_mixed_corpora(tmp_path / "corpus")
    spool, out = tmp_path / "spool", tmp_path / "drafter"
    out.mkdir()
    settings = settings_for(spool, corpora)
    _, plan, data = open_stream(settings, training(batch_size=4), rank=0, world=1, target_config=ECHO, out_dir=out)
    producer = echo_producer(spool, plan)
    lo, hi = plan.steps()[0]
    for _ in {plan.unit_at(p).id for p in range(lo, hi)}:  # the first step's units, first used first
        with Spool(spool).lock():
            unit, lease = producer.choose()
        producer.capture(unit, lease)
    next(data.epoch(0))
    data.close()
    Spool(spool).mark_done({"steps": 3})
    (out / "job.json").write_text(json.dumps({"stream": settings.model_dump(mode="json"), "datasets": {}}))
    recorded = trained_layers(out)
    assert recorded["aux_layer_ids"] == LAYER_IDS
    _, _, again = open_stream(settings_for(spool, corpora, cap_bytes=9 << 20), training(batch_size=4), rank=0, world=1,
                              target_config=ECHO, out_dir=out)
    again.close()
    assert not (spool / "layers.json").exists() and not (spool / "done.json").exists()  # the spool starts clean
    assert trained_layers(out) == recorded


# ---- the streaming step (StreamRun) with a launcher whose producers do what the test says ----------------------

class Proc:
    def __init__(self, log: Path, code):
        self.log, self.code = log, code
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("a producer's output\n")

    def poll(self):
        return self.code

    def queued(self):
        return False

    def stop(self, grace_s=10.0):
        self.code = -15


class Launcher:
    def __init__(self, code):
        self.code, self.procs = code, []

    @property
    def starts(self) -> int:
        return len(self.procs)

    def start(self, context, launch, folder):
        self.procs.append(Proc(Path(folder) / "output.log", self.code))
        return self.procs[-1]

    def finish(self):
        """Producers still running end by themselves, as after a run marked done."""
        for p in self.procs:
            p.code = 0 if p.code is None else p.code


class Log:
    def __init__(self):
        self.lines = []

    def __getattr__(self, level):
        return lambda msg: self.lines.append((level, msg))


@pytest.fixture
def step(tmp_path, model_dir):
    """A StreamRun as ``drafter_checkpoint`` opens it, around a launcher the test controls."""
    from eagle3_assets.drafter.assets import StreamingConfig
    from eagle3_assets.drafter.stream_run import StreamRun
    from eagle3_assets.resources import SlurmResource, TargetResource, VLLMResource

    corpora = make_mixed_corpora(tmp_path / "corpus")
    target = TargetResource(model=str(model_dir), device="cpu", dtype="float32", threads=1)
    resources = SimpleNamespace(target=target, vllm=VLLMResource(), slurm=SlurmResource())

    def make(code, restarts=2, run_id="run-2"):
        log = Log()
        context = SimpleNamespace(log=log, run_id=run_id)
        launcher = Launcher(code)
        run = StreamRun(context, settings_for(tmp_path / "spool", corpora), target, tmp_path / "out", launcher,
                        "producer", StreamingConfig(producer_restarts=restarts), resources, check_s=0.02)
        return run, launcher, log

    return make


def test_spent_restarts_fail_the_run_once_and_the_trainer_with_it(step, tmp_path):
    """Producers that keep failing: restarted twice, then the step records in the spool that the run
    cannot go on (the trainer stops at its next wait) and logs it once, not every check."""
    run, launcher, log = step(code=1)
    marker = tmp_path / "spool" / "failed.json"
    with run:
        deadline = time.monotonic() + 3
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # many more checks
    assert launcher.starts == 3 and [lvl for lvl, _ in log.lines].count("error") == 1  # before: one every check
    failed = json.loads(marker.read_text())  # before: none; the trainer waited for ever
    assert "restart(s) are spent" in failed["error"] and "output.log" in failed["error"]


def test_a_producer_that_found_the_disk_full_is_not_restarted(step, tmp_path):
    run, launcher, log = step(code=2)
    with run:  # what the producer records before it ends (Spool.mark_failed)
        (tmp_path / "spool" / "failed.json").write_text(json.dumps({"by": "producer producer-0",
                                                                    "error": "disk full writing /spool/tmp/x: No space left"}))
        time.sleep(0.3)
    assert launcher.starts == 1
    errors = [m for lvl, m in log.lines if lvl == "error"]
    assert len(errors) == 1 and "disk full writing /spool/tmp/x" in errors[0]


def test_a_rerun_shows_its_own_preflight_not_the_last_runs(step, tmp_path):
    """The earlier run's preflight.json is not this run's: the trainer writes this run's later."""
    spool = tmp_path / "spool"
    spool.mkdir()

    def figures(cap, idle):
        return {"offline_bytes": 20, "corpus_samples": 12, "corpus_tokens": 327, "cap_bytes": cap, "min_cap_bytes": 5,
                "units": 3, "mode": "recapture", "captured_tokens": 327, "trainer_idle_share": idle}

    (spool / "preflight.json").write_text(json.dumps(figures(1, None)))
    run, launcher, log = step(code=None)
    with run:
        time.sleep(0.2)
        assert run.preflight is None  # the old file is gone; this run's trainer has not written its own yet
        (spool / "preflight.json").write_text(json.dumps(figures(10, 0.5)))
        time.sleep(0.2)
        assert run.preflight["cap_bytes"] == 10
        launcher.finish()
    shown = [m for _, m in log.lines if "stream preflight" in m]
    assert len(shown) == 1 and "cap 10 bytes" in shown[0] and "idle share 50%" in shown[0]


def test_the_metadata_counts_this_runs_captures_not_the_earlier_runs(step, tmp_path):
    """After a kill and a relaunch the captures journal holds the earlier run's units too; the
    counts, like the timings, are this run's."""
    spool = tmp_path / "spool"
    old = [{"unit": f"e0000-u{i:06d}", "producer": "producer-0", "run": "run-1", "samples": ["a03", "a10"]}
           for i in range(5)]
    run, launcher, log = step(code=None, run_id="run-2")
    with run:
        job = json.loads((tmp_path / "out" / "stream" / "producer-0.json").read_text())
        new = [{"unit": f"e0000-u{i:06d}", "producer": "producer-0", "run": job.get("run"), "samples": ["b07"]}
               for i in range(2)]
        (spool / "captures.jsonl").write_text("".join(json.dumps(c) + "\n" for c in old + new))
        progress = run.progress(0)
        launcher.finish()
    figures = run.figures({"stream": {"units": 4}})
    assert (figures["stream_units_captured"], figures["stream_samples_captured"]) == (2, 2)  # before: 7 and 12
    assert progress.startswith("capture 2 of")


def test_logging_is_quiet_when_nothing_fails(step):
    run, launcher, log = step(code=None)
    with run:
        time.sleep(0.1)
        launcher.finish()
    assert launcher.starts == 1 and not [m for lvl, m in log.lines if lvl == "error"]



def test_the_trainer_refuses_a_cap_that_cannot_work_in_one_line_with_exit_2(tmp_path, model_dir, capsys):
    """As the step launches it (``python -m eagle3_assets.drafter.training --config``): one line naming the
    setting, status 2, no plan left in the spool."""
    from eagle3_assets.drafter.training.__main__ import main
    from tests.support.streaming import train_job

    corpora = make_mixed_corpora(tmp_path / "corpus")
    job = train_job(model_dir, tmp_path / "drafter", stream=settings_for(tmp_path / "spool", corpora, cap_bytes=1000))
    assert main(["--config", str(job.write(tmp_path / "job.json"))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "stream.cap_bytes = 1,000 is below" in err[-1]
    assert "Traceback" not in "\n".join(err) and not (tmp_path / "spool" / "plan.json").exists()
