"""Streaming hidden states: the plan follows the offline sampler, the spool's cap and leases hold,
and a drafter trained from the spool (a real producer process capturing with the embedded
model) equals the one trained offline from ``extract_corpus``'s shards, bit for bit on CPU, on two
datasets of mixed lengths; with several rows a forward the captured states agree to bf16 rounding.

Faults (a full disk, rotten units, refused caps, the step's restarts) are in test_streaming_faults.py;
kills (trainer, producer, both) in tests/integration/pipeline/test_streaming_kills.py.
"""

import json
import math
import subprocess
import sys

import pytest
import torch

from eagle3_assets.drafter.training.checkpoints import latest_checkpoint, load_checkpoint
from eagle3_assets.drafter.training.data import ShardBatches, ShardDataset
from eagle3_assets.drafter.training.stream import StreamDataset
from eagle3_assets.hidden_states.spool.plan import Plan, build_plan, train_entries, write_plan
from eagle3_assets.hidden_states.spool.preflight import CapTooSmall, check_cap, stream_preflight
from eagle3_assets.hidden_states.spool.store import Spool
from tests.support.streaming import (
    LAYER_IDS,
    Sampler,
    filesystem_bytes,
    make_corpus,
    make_mixed_corpora,
    producer_job,
    spawn_producer,
    stream_settings,
    train_job,
    training,
)

H = 576


class _Keys(torch.utils.data.Dataset):
    """A dataset of one-token samples whose only content is their key: what the offline loader yields."""

    def __init__(self, entries):
        self.entries = entries

    def __len__(self):
        return len(self.entries)

    def __getitem__(self, i):
        d, sid = self.entries[i]
        one = torch.zeros(1, dtype=torch.int64)
        return {"input_ids": one, "loss_mask": one, "aux_hidden": torch.zeros(1, 3), "last_hidden": torch.zeros(1, 1),
                "key": f"{d}:{sid}"}


@pytest.mark.parametrize("world,batch,n,weight", [(1, 3, 12, 1.0), (2, 4, 11, 1.0), (4, 8, 13, 1.5), (1, 5, 12, 1.0)])
def test_plan_positions_are_the_offline_loaders_batches(tmp_path, world, batch, n, weight):
    corpus = make_corpus(tmp_path / "c.parquet", n=n)
    settings = stream_settings(tmp_path / "spool", corpus, corpora={str(corpus): weight}, cap_bytes=1 << 40)
    names, entries, _ = train_entries(settings.corpora, seed=3)
    per_epoch = math.ceil((len(entries) // world * world) / batch)
    plan = Plan(json.loads(json.dumps(build_plan(settings, seed=3, batch_size=batch, world=world, total_steps=2 * per_epoch + 1,
                                                 hidden_size=H, max_length=64))))
    offline = [ShardBatches(_Keys(entries), batch, seed=3, rank=r, world_size=world) for r in range(world)]
    assert len(offline[0]) == per_epoch
    steps = iter(plan.steps())
    for epoch in range(3):
        for b, per_rank in enumerate(zip(*(o.epoch(epoch) for o in offline))):
            if epoch == 2 and b >= 1:
                break
            lo, hi = next(steps)
            for r, got in enumerate(per_rank):
                assert got["keys"] == [plan.key(p) for p in range(lo + r, hi, world)], (epoch, b, r)
    assert next(steps, None) is None  # nothing planned past the run's last step
    # every position's unit holds its sample; recapture: each unit read in one epoch, consecutively
    for pos in range(plan.total_positions):
        u = plan.unit_at(pos)
        assert plan.sample_at(pos)[1] in u.samples and u.first_use <= pos <= u.last_use
    assert all(u.last_use // plan.epoch_length == u.first_use // plan.epoch_length for u in plan.units)


def test_keep_plan_captures_each_sample_once_and_holds_it_to_its_last_epoch(tmp_path):
    corpus = make_corpus(tmp_path / "c.parquet", n=10)
    settings = stream_settings(tmp_path / "spool", corpus, epochs="keep", cap_bytes=1 << 40)
    plan = Plan(build_plan(settings, seed=0, batch_size=4, world=1, total_steps=7, hidden_size=H, max_length=64))
    held = [s for u in plan.units for s in u.samples]
    assert sorted(held) == sorted(set(held)) == [f"s{i:03d}" for i in range(10)]
    last_epoch = (plan.total_positions - 1) // plan.epoch_length
    assert last_epoch == 2
    for u in plan.units:
        last = max(p for p in range(plan.total_positions) if plan.sample_at(p)[1] in u.samples)
        assert u.last_use == last


def test_preflight_refuses_a_cap_below_one_step_naming_the_setting(tmp_path):
    corpus = make_corpus(tmp_path / "c.parquet", n=12)
    settings = stream_settings(tmp_path / "spool", corpus, cap_bytes=600_000)
    plan = write_plan(tmp_path / "spool", build_plan(settings, seed=0, batch_size=3, world=1, total_steps=4, hidden_size=H,
                                                     max_length=64))
    f = stream_preflight(plan, spool_dir=tmp_path / "spool", capture_tokens_per_s=100.0, train_tokens_per_s=400.0)
    assert f["trainer_idle_share"] == pytest.approx(0.75) and f["producer_idle_share"] == 0.0
    tokens = sum(len(x) for x in __import__("polars").read_parquet(corpus)["input_ids"].to_list())
    assert f["corpus_tokens"] == tokens and f["offline_bytes"] > tokens * (8 * H)
    with pytest.raises(CapTooSmall, match=r"stream\.cap_bytes = 600,000 is below"):
        check_cap(f)
    keep = stream_settings(tmp_path / "spool2", corpus, cap_bytes=1 << 40, epochs="keep")
    kplan = write_plan(tmp_path / "spool2", build_plan(keep, seed=0, batch_size=3, world=1, total_steps=8, hidden_size=H,
                                                       max_length=64))
    kf = stream_preflight(kplan, spool_dir=tmp_path / "spool2")
    check_cap(kf)
    assert kf["min_cap_bytes"] < kf["keep_bytes"]
    with pytest.raises(CapTooSmall, match=r"stream\.epochs = 'keep'"):  # enough for a step, not for the corpus
        check_cap({**kf, "cap_bytes": kf["min_cap_bytes"]})
    other = build_plan(settings, seed=1, batch_size=3, world=1, total_steps=4, hidden_size=H, max_length=64)
    with pytest.raises(ValueError, match="an unfinished run's plan"):  # a relaunch with other settings
        write_plan(tmp_path / "spool", other)
    # once that run is done, a run with other settings (the recipe materialized again) starts on a clean spool
    Spool(tmp_path / "spool").mark_done({"steps": 4})
    (tmp_path / "spool" / "cursor.json").write_text('{"position": 12, "step": 4}')
    write_plan(tmp_path / "spool", other)
    assert sorted(p.name for p in (tmp_path / "spool").iterdir()) == ["plan.json"]
    assert json.loads((tmp_path / "spool" / "plan.json").read_text()) == json.loads(json.dumps(other))


def test_a_tensor_parallel_producer_with_several_ranks_is_refused_naming_the_setting(tmp_path, model_dir):
    from contextlib import ExitStack

    from eagle3_assets.hidden_states.spool.produce import build_producer_extractor

    corpus = make_corpus(tmp_path / "c.parquet", n=6)
    settings = stream_settings(tmp_path / "spool", corpus)
    plan = write_plan(tmp_path / "spool", build_plan(settings, seed=0, batch_size=3, world=1, total_steps=2, hidden_size=H,
                                                     max_length=64))
    job = producer_job(tmp_path / "spool", model_dir).model_copy(update={"backend": "sglang", "tp_size": 2})
    with ExitStack() as stack, pytest.raises(ValueError, match=r"tp_size 2 for backend 'sglang'.*tp_size: 1"):
        build_producer_extractor(job, plan, stack)  # refused before SGLang is imported (not installed here)


def test_a_producer_started_after_the_run_ended_loads_no_engine_and_ends(tmp_path):
    """A replacement that only starts once the run is done (``done.json``) ends at once with empty
    stats: the same job, before the run is done, goes on to load its target (here: no such model)."""
    from eagle3_assets.hidden_states.spool.produce import run_producer

    corpus = make_corpus(tmp_path / "c.parquet", n=6)
    settings = stream_settings(tmp_path / "spool", corpus)
    write_plan(tmp_path / "spool", build_plan(settings, seed=0, batch_size=3, world=1, total_steps=2, hidden_size=H,
                                              max_length=64))
    job = producer_job(tmp_path / "spool", tmp_path / "no-such-model")
    with pytest.raises(Exception, match="no-such-model"):
        run_producer(job)
    Spool(tmp_path / "spool").mark_done({"steps": 2})
    stats = run_producer(job)
    assert (stats["units"], stats["capture_s"]) == (0, 0.0) and not any((tmp_path / "spool" / "leases").iterdir())


def test_a_dead_producers_lease_goes_back_to_the_pool_with_its_folder(tmp_path):
    spool = Spool(tmp_path / "spool")
    victim = subprocess.Popen([sys.executable, "-c",
                               "import sys; from eagle3_assets.hidden_states.spool.store import Spool; "
                               "s = Spool(sys.argv[1]); l = s.take('u1', 1000, 'victim'); "
                               "open(s.tmp_dir / l['tmp'] / 'part', 'w').write('x' * 500); print('ok', flush=True); "
                               "import time; time.sleep(60)", str(tmp_path / "spool")], stdout=subprocess.PIPE, text=True)
    assert victim.stdout.readline().strip() == "ok"
    assert spool.take("u1", 1000, "other") is None  # O_EXCL: one holder
    assert spool.reserved() == 1000 and spool.used() >= 1000
    assert spool.reclaim() == []  # alive: kept
    victim.kill()
    victim.wait()
    assert spool.reclaim() == ["u1"]
    assert not any(spool.tmp_dir.iterdir()) and not any(spool.leases_dir.iterdir()) and spool.reserved() == 0
    assert spool.take("u1", 1000, "other") is not None


@pytest.mark.model
def test_token_counts_from_the_corpus_equal_the_offline_shards(offline):
    shards, corpora = offline["shards"], offline["corpora"]
    settings = stream_settings(shards["a"].parent / "unused", corpora["a"],
                               corpora={str(corpora["a"]): 1.5, str(corpora["b"]): 1.0})
    for max_length in (64, 20):
        off = ShardDataset({str(shards["a"]): 1.5, str(shards["b"]): 1.0}, max_length=max_length, seed=0)
        on = StreamDataset(settings, max_length=max_length, seed=0, target_layers=30)
        assert on.entries == off.entries  # the same order too: the permutation draws from it
        assert torch.equal(on.token_counts(49152), off.token_counts(49152))


def every_key(corpora: dict) -> list[str]:
    """``dataset index:sample id`` of every train sample, the datasets in the plan's (sorted) order."""
    import polars as pl

    return sorted(f"{d}:{sid}" for d, path in enumerate(sorted(str(p) for p in corpora.values()))
                  for sid in pl.read_parquet(path)["sample_id"].to_list())


@pytest.fixture(scope="module")
def offline(model_dir, tmp_path_factory):
    """The offline path on two datasets of mixed lengths: extract_corpus's shards (one row a forward,
    one torch thread), then run_job on both, and the keys each step trained, from the offline loader."""
    from eagle3_assets.drafter.training.job import run_job
    from eagle3_assets.engines.local.extractor import LocalExtractor
    from eagle3_assets.hidden_states.extract import extract_corpus

    tmp = tmp_path_factory.mktemp("offline")
    corpora = make_mixed_corpora(tmp / "corpus")
    shards = {name: tmp / "shards" / name for name in corpora}
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ex = LocalExtractor(model_dir, layer_ids=LAYER_IDS, device="cpu", dtype="float32")
        for name, corpus in corpora.items():
            extract_corpus(corpus, shards[name], ex, batch_tokens=1, shard_bytes=1 << 40)  # one row a forward
        datasets = {str(d): 1.0 for d in shards.values()}
        summary = run_job(train_job(model_dir, tmp / "train", datasets=datasets))
        loader = ShardBatches(ShardDataset(datasets, max_length=64), 3)
        keys = [b["keys"] for e in range(math.ceil(summary["steps"] / len(loader))) for b in loader.epoch(e)]
    finally:
        torch.set_num_threads(old)
    return {"corpora": corpora, "shards": shards, "train": tmp / "train", "summary": summary, "keys": keys,
            "extractor": ex}


@pytest.mark.model
@pytest.mark.parametrize("producers", [1, 2], ids=["one-producer", "two-producers"])
def test_streaming_trains_the_same_drafter_as_offline_bit_for_bit(offline, model_dir, tmp_path, producers):
    """Two datasets of mixed lengths: the trainer takes the offline loader's samples step by step, and,
    whichever producer captured a unit, trains the same drafter: two producers on one spool (each its
    own process, leases deciding who captures what) too."""
    from eagle3_assets.drafter.training.job import run_job

    spool = tmp_path / "spool"
    corpora = offline["corpora"]
    settings = stream_settings(spool, corpora["a"], corpora={str(p): 1.0 for p in corpora.values()}, cap_bytes=1_900_000,
                               batch_tokens=1)
    procs = []
    for i in range(producers):
        job_path = tmp_path / f"producer-{i}.json"
        job_path.write_text(producer_job(spool, model_dir, name=f"p{i}").model_dump_json())
        procs.append(spawn_producer(job_path, tmp_path / f"producer-{i}.log"))
    sampler = Sampler(spool)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = run_job(train_job(model_dir, tmp_path / "train", stream=settings))
    finally:
        torch.set_num_threads(old)
        for i, producer in enumerate(procs):
            assert producer.wait(60) == 0, (tmp_path / f"producer-{i}.log").read_text()[-3000:]
        peak = sampler.stop()

    a = load_checkpoint(latest_checkpoint(offline["train"]))
    b = load_checkpoint(latest_checkpoint(tmp_path / "train"))
    assert a["step"] == b["step"] == summary["steps"] == offline["summary"]["steps"] == 4
    for name, t in a["model"].items():
        assert torch.equal(t, b["model"][name]), name
    assert [m["loss"] for m in a["metrics"]] == [m["loss"] for m in b["metrics"]]
    assert summary["vocab_map"] == offline["summary"]["vocab_map"]
    # the trainer's own records: every sample once, in the order the offline loader gave, step by step
    assert [m["consumed"]["ids"] for m in b["metrics"]] == offline["keys"][: len(b["metrics"])]
    trained = [k for m in b["metrics"] for k in m["consumed"]["ids"]]
    assert sorted(trained) == every_key(corpora)
    assert peak <= settings.cap_bytes and sampler.samples > 10
    assert not any((spool / "units").iterdir()) and not any((spool / "leases").iterdir())
    assert not any((spool / "tmp").iterdir())
    captured = [json.loads(line) for line in (spool / "captures.jsonl").read_text().splitlines()]
    assert sorted(s for c in captured for s in c["samples"]) == sorted(k.split(":")[1] for k in trained)
    assert {c["producer"] for c in captured} == {f"p{i}" for i in range(producers)}  # each captured its share
    assert summary["stream"]["wait_s"] > 0
    stored = sum(filesystem_bytes(d) for d in offline["shards"].values())
    print(f"peak spool bytes {peak:,} of cap {settings.cap_bytes:,}; offline shards {stored:,}")


def within_bf16_rounding(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference per token as a share of one bf16 rounding step at that token's scale
    (2^-8 of its largest value): at most 1 when ``a`` and ``b`` agree to bf16 rounding."""
    a, b = a.float(), b.float()
    step = torch.maximum(a.abs(), b.abs()).amax(-1, keepdim=True).clamp(min=1e-30) * 2.0 ** -8
    return float(((a - b).abs() / step).max()) if a.numel() else 0.0


@pytest.mark.model
def test_with_several_rows_a_forward_the_captured_states_agree_with_the_shards_to_bf16_rounding(offline, model_dir,
                                                                                                   tmp_path):
    """The documented tolerance (docs/streaming.md): a unit batches its own rows, the offline pass the
    corpus's, so a float32 state may round to the neighbouring bf16 value; every difference stays
    within one bf16 rounding step of its token's largest value."""
    import polars as pl

    from eagle3_assets.drafter.training.stream import open_stream
    from eagle3_assets.hidden_states.extract import extract_corpus
    from eagle3_assets.hidden_states.reader import ShardReader
    from eagle3_assets.hidden_states.spool.produce import Producer

    corpora, ex = offline["corpora"], offline["extractor"]
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        shards = {}
        for name, corpus in corpora.items():
            extract_corpus(corpus, tmp_path / "hs" / name, ex, batch_tokens=4096, shard_bytes=1 << 40)
            shards.update({(str(corpus), s.sample_id): s for s in ShardReader(tmp_path / "hs" / name).iter_samples()})
        settings = stream_settings(tmp_path / "spool", corpora["a"], corpora={str(p): 1.0 for p in corpora.values()},
                                   batch_tokens=4096, cap_bytes=1 << 30)
        _, plan, data = open_stream(settings, training(), rank=0, world=1,
                                    target_config={"num_hidden_layers": 30, "hidden_size": H})
        data.close()
        producer = Producer(producer_job(tmp_path / "spool", model_dir), ex, plan)
        while (picked := producer.choose()) is not None:
            producer.capture(*picked)
    finally:
        torch.set_num_threads(old)
    worst, equal, seen = 0.0, 0, 0
    for unit in plan.units:
        for s in ShardReader(tmp_path / "spool" / "units" / unit.id).iter_samples():
            o = shards[(plan.corpora[unit.dataset], s.sample_id)]
            worst = max(worst, within_bf16_rounding(s.aux_hidden, o.aux_hidden),
                        within_bf16_rounding(s.last_hidden, o.last_hidden))
            equal += torch.equal(s.aux_hidden, o.aux_hidden) and torch.equal(s.last_hidden, o.last_hidden)
            seen += 1
    assert seen == sum(pl.read_parquet(c).height for c in corpora.values()) and worst <= 1.0
    print(f"{equal} of {seen} samples bit-equal; the largest difference {worst:.3f} of a bf16 step at its token's scale")


@pytest.mark.model
def test_a_non_finite_sample_is_quarantined_in_its_unit_and_never_trained(model_dir, tmp_path):
    """The writer's checks hold for what a producer captures: the poisoned sample is recorded as
    quarantined by its unit and the step's record, and no batch holds it."""
    import threading

    import polars as pl

    from eagle3_assets.drafter.training.stream import StreamBatches
    from eagle3_assets.engines.local.extractor import LocalExtractor
    from eagle3_assets.hidden_states.spool.produce import Producer

    corpus = make_corpus(tmp_path / "c.parquet")
    poisoned = pl.read_parquet(corpus).row(5, named=True)
    spool_dir = tmp_path / "spool"
    plan = write_plan(spool_dir, build_plan(stream_settings(spool_dir, corpus, cap_bytes=1 << 30), seed=0, batch_size=3,
                                            world=1, total_steps=4, hidden_size=H, max_length=64))

    class Poison(LocalExtractor):
        def extract(self, rows):
            feats = super().extract(rows)
            for f, r in zip(feats, rows):
                if list(r) == poisoned["input_ids"]:
                    f.aux = f.aux.clone()
                    f.aux[2, 7] = float("nan")
            return feats

    producer = Producer(producer_job(spool_dir, model_dir), Poison(model_dir, layer_ids=LAYER_IDS, device="cpu"), plan)
    thread = threading.Thread(target=producer.run, kwargs={"stop_when_idle": True})
    thread.start()
    data = StreamBatches(plan, Spool(spool_dir), max_length=64, poll_s=0.01, wait_timeout_s=60)
    seen, quarantined = [], []
    for step, batch in enumerate(data.epoch(0), 1):
        record = batch.pop("record")
        seen += batch["keys"]
        quarantined += record["quarantined"]
        if f"0:{poisoned['sample_id']}" in record["ids"]:
            unit = plan.unit_at(record["ids"].index(f"0:{poisoned['sample_id']}") + record["positions"][0])
            index = pl.read_parquet(spool_dir / "units" / unit.id / "index.parquet").filter(pl.col("quarantined"))
            assert index["sample_id"].to_list() == [poisoned["sample_id"]]
            assert "non-finite" in index["reason"][0]
        data.after_step({"consumed": record, "step": step})
    thread.join(60)
    assert quarantined == [f"0:{poisoned['sample_id']}"]
    assert sorted(seen + quarantined) == [f"0:s{i:03d}" for i in range(12)]
    assert not any((spool_dir / "units").iterdir())


@pytest.mark.model
def test_two_ranks_stream_the_same_global_batches(offline, model_dir, tmp_path):
    """torchrun with two ranks over the spool: each rank its share of every global batch, rank 0
    deletes after the barrier; the drafter matches the one-process offline run (DDP's reduction
    order aside) and the spool ends empty."""
    import os

    from tests.support.streaming import env

    spool = tmp_path / "spool"
    corpora = offline["corpora"]
    settings = stream_settings(spool, corpora["a"], corpora={str(p): 1.0 for p in corpora.values()}, cap_bytes=1_900_000,
                               batch_tokens=1)
    job = train_job(model_dir, tmp_path / "train", stream=settings, settings=training(batch_size=4))
    off_job = train_job(model_dir, tmp_path / "offline", datasets={str(d): 1.0 for d in offline["shards"].values()},
                        settings=training(batch_size=4))
    (tmp_path / "producer.json").write_text(producer_job(spool, model_dir).model_dump_json())
    producer = spawn_producer(tmp_path / "producer.json", tmp_path / "producer.log")
    ddp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "eagle3_assets.drafter.training", "--config", str(job.write(tmp_path / "job.json"))],
                         env=env(), cwd=os.getcwd(), capture_output=True, text=True, timeout=300)
    assert ddp.returncode == 0, ddp.stdout[-3000:] + ddp.stderr[-3000:]
    assert producer.wait(60) == 0
    single = subprocess.run([sys.executable, "-m", "eagle3_assets.drafter.training", "--config",
                             str(off_job.write(tmp_path / "off.json"))], env=env(), capture_output=True, text=True,
                            timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    a = load_checkpoint(latest_checkpoint(tmp_path / "offline"))
    b = load_checkpoint(latest_checkpoint(tmp_path / "train"))
    assert a["step"] == b["step"] == 3 and b["world_size"] == 2
    for name, t in a["model"].items():
        assert torch.allclose(t.float(), b["model"][name].float(), rtol=1e-4, atol=1e-4), name
    for ma, mb in zip(a["metrics"], b["metrics"]):
        assert ma["tokens"] == mb["tokens"] and ma["positions"] == mb["positions"]
    trained = [k for m in b["metrics"] for k in m["consumed"]["ids"]]
    assert sorted(trained) == every_key(corpora)
    assert not any((spool / "units").iterdir()) and not any((spool / "tmp").iterdir())


def test_producers_pause_at_the_high_mark_resume_below_the_low_and_evict_for_the_unit_the_trainer_needs(tmp_path):
    """``Producer.choose`` against a spool whose bytes are real files: a unit nobody waits on is not
    started above the high mark (reservations counted) until the spool is below the low mark; the unit the trainer needs
    next is always started, by deleting the latest published units when the cap is full."""
    from eagle3_assets.hidden_states.spool.produce import Producer

    corpus = make_corpus(tmp_path / "c.parquet", n=12)
    spool_dir = tmp_path / "spool"
    settings = stream_settings(spool_dir, corpus, cap_bytes=1 << 40, unit_bytes=300_000)
    data = build_plan(settings, seed=0, batch_size=3, world=1, total_steps=4, hidden_size=H, max_length=64)
    bounds = [u["bytes"] for u in data["units"]]
    data.update(cap_bytes=3 * max(bounds) + 50_000, high_water=0.8, low_water=0.5)
    plan = write_plan(spool_dir, data)
    spool, cap = Spool(spool_dir), plan.cap_bytes
    producer = Producer(producer_job(spool_dir, tmp_path), None, plan)
    units = sorted(plan.units, key=lambda u: u.first_use)

    def publish(u, size=None):
        (spool.unit_dir(u.id)).mkdir()
        (spool.unit_dir(u.id) / "blob").write_bytes(b"x" * (size or u.bytes))

    def choose():
        with spool.lock():
            return producer.choose()

    # the trainer's next unit is taken by another (live) producer; units[1] fills the spool above the high mark
    assert spool.take(units[0].id, units[0].bytes, "other") is not None
    publish(units[1], int(0.85 * cap) - units[0].bytes)
    assert choose() is None and producer.paused  # paused: units[2] is not what the trainer waits on
    spool.remove_unit(units[1].id)
    publish(units[1], int(0.6 * cap) - units[0].bytes)
    assert choose() is None and producer.paused  # between the marks: still paused (hysteresis)
    spool.remove_unit(units[1].id)
    publish(units[1], int(0.4 * cap) - units[0].bytes)
    unit, lease = choose()  # below the low mark: resumes
    assert unit.id == units[2].id and not producer.paused
    spool.drop(lease)
    spool.drop({"path": str(spool.leases_dir / f"{units[0].id}.json")})

    # a crash put the trainer's next unit back; later units fill the cap: the latest go, it is taken
    for p in spool.units_dir.iterdir():
        spool.remove_unit(p.name)
    for u in units[1:4]:
        publish(u)
    assert spool.used() + units[0].bytes > cap
    unit, lease = choose()
    assert unit.id == units[0].id
    left = sorted(spool.published())
    assert units[3].id not in left and units[1].id in left  # the latest went first
    assert spool.used() <= cap and filesystem_bytes(spool_dir) <= cap


def test_a_wrapped_targets_config_plans_from_its_text_config(tmp_path):
    """A multimodal checkpoint (kimi-mini, Kimi-K2.5) keeps its layer count and hidden size under ``text_config``:
    the stream plans from them as it does from a flat config's."""
    from eagle3_assets.drafter.training.stream import open_stream

    corpus = make_corpus(tmp_path / "c.parquet", n=6)
    text = {"num_hidden_layers": 7, "hidden_size": 64}
    plans = []
    for name, config in [("flat", text), ("wrapped", {"model_type": "kimi_k25", "text_config": text})]:
        settings = stream_settings(tmp_path / name, corpus, layer_ids=[1, 2, 3], cap_bytes=1 << 30)
        _dataset, plan, data = open_stream(settings, training(), rank=0, world=1, target_config=config)
        data.close()
        plans.append(json.loads((tmp_path / name / "plan.json").read_text()))
        assert plan.data["hidden_size"] == 64
    assert plans[0] == plans[1]
