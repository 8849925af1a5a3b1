"""The pipelined extraction: the same bytes as the per-row path, the states of a bare forward, and
crash safety with several shards in flight (out of order, and under a real SIGKILL)."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import polars as pl
import pytest
import torch

from eagle3_assets.engines.local.extractor import LocalExtractor
from eagle3_assets.hidden_states import encoding
from eagle3_assets.hidden_states.extract import extract_corpus, plan_batches, verify_shards
from eagle3_assets.hidden_states.reader import ShardReader
from eagle3_assets.hidden_states.shards import ShardWriter, read_progress
from tests.unit.hidden_states.test_hidden_states import LENGTHS, TWO_SAMPLES, Fake, Wrapped, make_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture(scope="module")
def extractor(model_dir):
    return LocalExtractor(model_dir)


def sequential_reference(corpus, out, extractor, *, dtype, shard_bytes, batch_tokens):
    """The path extract_corpus took before the pipeline: per batch the forward, then per row the
    finiteness check and ``ShardWriter.add`` (its per-row copy and encoding), writes in line."""
    frame = pl.read_parquet(corpus)
    desc = extractor.describe()
    writer = ShardWriter(out, hidden_size=extractor.hidden_size, dtype=dtype, shard_bytes=shard_bytes,
                         meta={"target": desc["target"], "layers": desc["layers"]}, background=False)
    lengths = [len(r) for r in frame["input_ids"].to_list()]
    for batch in plan_batches(lengths, batch_tokens):
        part = frame[batch]
        ids = part["input_ids"].to_list()
        for sid, split, row, mask, f in zip(part["sample_id"], part["split"], ids, part["loss_mask"].to_list(),
                                            extractor.extract(ids)):
            assert torch.isfinite(f.aux).all() and torch.isfinite(f.last).all()
            writer.add(sid, split, row, mask, f.aux, f.last)
    return writer.close()


def digests(out):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("shard-*.safetensors"))}


VOLATILE = ("created_at", "updated_at", "corpus", "backend", "extraction")


@pytest.mark.model
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_pipelined_shards_are_byte_identical_to_the_per_row_path(extractor, tmp_path, dtype):
    corpus = make_corpus(tmp_path / "corpus.parquet")
    new, old = tmp_path / "new", tmp_path / "old"
    report = extract_corpus(corpus, new, extractor, dtype=dtype, shard_bytes=TWO_SAMPLES // 2, batch_tokens=100,
                            shards_in_flight=3)
    shards = 6 if dtype == "bf16" else 3  # one sample a shard in bf16, two in fp8 (half the bytes)
    assert report.batches == 3 and report.shards_total == shards and report.extracted == 6
    manifest = sequential_reference(corpus, old, extractor, dtype=dtype, shard_bytes=TWO_SAMPLES // 2, batch_tokens=100)
    assert digests(new) == digests(old) and len(digests(new)) == shards
    got = json.loads((new / "manifest.json").read_text())
    assert {k: v for k, v in got.items() if k not in VOLATILE} == {k: v for k, v in manifest.items() if k not in VOLATILE}
    assert pl.read_parquet(new / "index.parquet").equals(pl.read_parquet(old / "index.parquet"))
    assert verify_shards(new, corpus).ok


@pytest.mark.model
def test_stored_states_are_a_bare_forwards(extractor, tmp_path):
    """The independent record: ``model(input_ids, attention_mask, output_hidden_states=True)`` on the same
    right-padded batch, in bf16, equals what the shards hold, bit for bit."""
    corpus = make_corpus(tmp_path / "corpus.parquet")
    out = tmp_path / "hs"
    extract_corpus(corpus, out, extractor, shard_bytes=TWO_SAMPLES, batch_tokens=4096)
    frame = pl.read_parquet(corpus)
    assert plan_batches(LENGTHS, 4096) == [[2, 5, 0, 3, 1, 4]]  # one batch, as the extraction ran it
    width = max(LENGTHS)
    ids = torch.full((6, width), extractor.pad_id, dtype=torch.long)
    mask = torch.zeros((6, width), dtype=torch.long)
    for i, row in enumerate(frame["input_ids"].to_list()):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    with torch.inference_mode():
        hs = extractor.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False).hidden_states
    index = json.loads((out / "manifest.json").read_text())["layers"]["hf_hidden_states_index"]
    reader = ShardReader(out)
    for i, (sid, n) in enumerate(zip(frame["sample_id"], LENGTHS)):
        s = reader.read(sid)
        assert torch.equal(s.aux_hidden, torch.cat([hs[j][i, :n] for j in index], -1).to(torch.bfloat16))
        assert torch.equal(s.last_hidden, hs[-1][i, :n].to(torch.bfloat16))


def test_shards_finishing_out_of_order_are_recorded_safely(tmp_path, monkeypatch):
    """Shard 0's write is held back until shard 1 is recorded; a kill then leaves shard 1 alone in the
    journal; the resumed run redoes shard 0's samples and stores every sample exactly once."""
    corpus = make_corpus(tmp_path / "corpus.parquet")
    out = tmp_path / "hs"
    real = encoding.write_safetensors
    calls = []

    def slow_first(path, tensors, meta):
        calls.append(path.name)
        if ".shard-00000." in path.name:
            deadline = time.monotonic() + 10
            while not (out / "progress.jsonl").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            raise OSError("simulated kill while shard 0 was being written")
        return real(path, tensors, meta)

    monkeypatch.setattr("eagle3_assets.hidden_states.shards.write_safetensors", slow_first)
    with pytest.raises(OSError, match="simulated kill"):
        extract_corpus(corpus, out, Fake(), shard_bytes=TWO_SAMPLES // 2, batch_tokens=100, shards_in_flight=2)
    records = [r for r in read_progress(out / "progress.jsonl") if r["kind"] == "shard"]
    recorded = [r["file"] for r in records]
    assert "shard-00000.safetensors" not in recorded and "shard-00001.safetensors" in recorded
    monkeypatch.setattr("eagle3_assets.hidden_states.shards.write_safetensors", real)
    again = Wrapped(Fake())
    report = extract_corpus(corpus, out, again, shard_bytes=TWO_SAMPLES // 2, batch_tokens=100)
    assert report.already_done == sum(r["n_samples"] for r in records) >= 1
    assert again.rows == 6 - report.already_done  # shard 0's samples redone, shard 1's kept
    index = pl.read_parquet(out / "index.parquet")
    assert sorted(index["sample_id"]) == [f"s{i:02d}" for i in range(6)]
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["file"] for s in manifest["shards"]] == sorted(s["file"] for s in manifest["shards"])
    v = verify_shards(out, corpus)
    assert v.ok, v.problems


KILLED_RUN = """
import sys, time
from eagle3_assets.hidden_states.extract import extract_corpus
from tests.unit.hidden_states.test_hidden_states import Fake

class Slow(Fake):
    def extract(self, rows):
        time.sleep(0.15)
        return super().extract(rows)

extract_corpus(sys.argv[1], sys.argv[2], Slow(), shard_bytes=int(sys.argv[3]), batch_tokens=50, shards_in_flight=3)
"""


def test_sigkill_mid_run_then_resume_stores_every_sample_once(tmp_path):
    lengths = [30 + (i * 7) % 20 for i in range(24)]
    corpus = make_corpus(tmp_path / "corpus.parquet", lengths=lengths)
    out = tmp_path / "hs"
    shard = TWO_SAMPLES // 2
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RUN, str(corpus), str(out), str(shard)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list(out.glob("shard-*.safetensors"))) < 4 and proc.poll() is None:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (out / "manifest.json").exists()
    kept = {r["file"] for r in read_progress(out / "progress.jsonl") if r["kind"] == "shard"}
    again = Wrapped(Fake())
    report = extract_corpus(corpus, out, again, shard_bytes=shard, batch_tokens=50)
    assert report.shards_kept == len(kept) >= 3
    assert again.rows == len(lengths) - report.already_done  # what was stored was not redone
    index = pl.read_parquet(out / "index.parquet")
    assert index.height == len(lengths) and index["sample_id"].n_unique() == len(lengths)
    v = verify_shards(out, corpus)
    assert v.ok, v.problems
