"""Hidden-state stage: layer convention, extraction round trip, shards, resume, quarantine, SGLang parts."""

import json

import polars as pl
import pytest
import torch

from eagle3_assets.engines.local.extractor import LocalExtractor
from eagle3_assets.engines.roles import Features, features_from_packed, split_packed
from eagle3_assets.hidden_states import encoding, shards, sizing
from eagle3_assets.hidden_states.extract import extract_corpus, plan_batches, verify_shards
from eagle3_assets.hidden_states.reader import ShardReader
from eagle3_assets.target import layers as hidden_layers

pytestmark = pytest.mark.model

LENGTHS = [40, 33, 47, 38, 29, 44]
H = 576
PER_TOKEN = sizing.bytes_per_token(H, "bf16")  # 8H + 5
TWO_SAMPLES = 2 * 47 * PER_TOKEN + 64  # shard size holding about two samples


@pytest.fixture(scope="module")
def extractor(model_dir):
    return LocalExtractor(model_dir)


def make_corpus(path, lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, n in enumerate(lengths):
        ids = torch.randint(3, 49152, (n,), generator=g).tolist()
        mask = [0] * (n // 2) + [1] * (n - n // 2)
        rows.append({"sample_id": f"s{i:02d}", "dataset": "t", "prompt_id": f"p{i}", "source": "local",
                     "input_ids": ids, "loss_mask": mask, "prompt_len": n // 2, "completion_len": n - n // 2,
                     "split": "eval" if i % 3 == 0 else "train"})
    frame = pl.DataFrame(rows, schema_overrides={"input_ids": pl.List(pl.Int32), "loss_mask": pl.List(pl.Int8)})
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.write_parquet(path)
    return path


class Fake:
    """Deterministic stand-in states (a function of the ids): storage tests without the forward pass."""

    hidden_size, vocab_size = H, 49152

    def describe(self):
        return {"target": {"name": "fake", "revision": None, "config_sha256": "0"},
                "layers": hidden_layers.convention([1, 14, 26], 30), "backend": "fake"}

    def extract(self, rows):
        out = []
        for r in rows:
            base = torch.tensor(r, dtype=torch.float32).unsqueeze(1) / 49152
            out.append(Features(base * torch.linspace(-3, 3, 3 * H), base * torch.linspace(-1, 1, H)))
        return out


class Wrapped:
    """Delegates to a real extractor; can fail after some batches or poison one sample."""

    def __init__(self, inner, *, fail_after=None, nan_row_len=None):
        self.inner, self.fail_after, self.nan_row_len = inner, fail_after, nan_row_len
        self.hidden_size, self.vocab_size = inner.hidden_size, inner.vocab_size
        self.batches, self.rows = 0, 0

    def describe(self):
        return self.inner.describe()

    def extract(self, rows):
        if self.fail_after is not None and self.batches >= self.fail_after:
            raise RuntimeError("simulated kill")
        self.batches += 1
        self.rows += len(rows)
        feats = self.inner.extract(rows)
        for f, r in zip(feats, rows):
            if len(r) == self.nan_row_len:
                f.aux = f.aux.clone()
                f.aux[3, 5] = float("nan")
        return feats


# ---- layer convention -------------------------------------------------------------------------

def test_default_layer_ids_and_mapping():
    assert hidden_layers.default_layer_ids(30) == [1, 14, 26]
    assert hidden_layers.default_layer_ids(61) == [1, 29, 57]  # Kimi-K2 / DeepSeek-V3
    assert [hidden_layers.hf_hidden_states_index(i, 30) for i in [1, 14, 26]] == [2, 15, 27]
    assert hidden_layers.to_speculators_ids([1, 14, 26]) == [2, 15, 27]
    with pytest.raises(ValueError, match="post-norm"):
        hidden_layers.hf_hidden_states_index(29, 30)
    with pytest.raises(ValueError, match="exactly 3"):
        hidden_layers.resolve_layer_ids(30, [1, 2])
    with pytest.raises(ValueError, match="outside"):
        hidden_layers.resolve_layer_ids(30, [1, 14, 30])
    conv = hidden_layers.convention([1, 14, 26], 30)
    assert conv["hf_hidden_states_index"] == [2, 15, 27] and conv["final"] == "post_norm"


def test_recorded_layer_ids_read_these_hf_indices(extractor, model_dir):
    """On the real model: which output_hidden_states entry each captured slice equals, bit for bit."""
    ids = torch.randint(3, 49152, (1, 37), generator=torch.Generator().manual_seed(1))
    (feat,) = extractor.extract([ids[0].tolist()])
    with torch.inference_mode():
        out = extractor.base(input_ids=ids, output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    assert len(hs) == extractor.num_layers + 1
    chunks = feat.aux.split(H, dim=-1)
    for layer_id, chunk in zip(extractor.layer_ids, chunks):
        matches = [j for j, h in enumerate(hs) if torch.equal(h[0], chunk)]
        assert matches == [hidden_layers.hf_hidden_states_index(layer_id, extractor.num_layers)] == [layer_id + 1]
    # The final state is the post-norm one: HF's hidden_states[-1] in transformers 5, not the raw last layer.
    assert torch.equal(feat.last, hs[-1][0])
    raw = {}
    h = extractor.base.layers[-1].register_forward_hook(lambda m, a, o: raw.setdefault("x", o[0] if isinstance(o, tuple) else o))
    try:
        extractor.extract([ids[0].tolist()])
    finally:
        h.remove()
    assert not torch.allclose(raw["x"][0], feat.last)
    assert torch.equal(extractor.base.norm(raw["x"])[0], feat.last)


# ---- round trip ---------------------------------------------------------------------------------

def test_round_trip_matches_hf_forward(extractor, tmp_path):
    corpus = make_corpus(tmp_path / "corpus.parquet")
    out = tmp_path / "hs"
    report = extract_corpus(corpus, out, extractor, shard_bytes=TWO_SAMPLES, batch_tokens=4096)
    assert report.extracted == 6 and report.batches == 1 and report.shards_total == 3
    v = verify_shards(out, corpus)
    assert v.ok, v.problems
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["layers"]["aux_layer_ids"] == [1, 14, 26]
    assert manifest["num_tokens"] == sum(LENGTHS) and manifest["hidden_size"] == H
    assert all(len(s["sha256"]) == 64 for s in manifest["shards"])
    idx_hf = manifest["layers"]["hf_hidden_states_index"]
    frame = pl.read_parquet(corpus)
    reader = ShardReader(out)
    for sid, ids, mask in frame.select("sample_id", "input_ids", "loss_mask").iter_rows():
        s = reader.read(sid)
        assert s.input_ids.tolist() == ids and s.loss_mask.tolist() == mask
        if len(ids) > 40:
            continue  # the direct forward is the slow part: check the 4 most padded rows
        with torch.inference_mode():
            hs = extractor.base(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        want_aux = torch.cat([hs[j][0] for j in idx_hf], dim=-1)
        torch.testing.assert_close(s.aux_hidden.float(), want_aux, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(s.last_hidden.float(), hs[-1][0], rtol=1e-2, atol=1e-2)
    # Padded and packed batches carry the same rows.
    first = next(reader.iter_batches(4))
    n0 = int(first["lengths"][0])
    assert torch.equal(first["aux_hidden"][0, :n0], reader.read(first["sample_ids"][0]).aux_hidden)
    assert first["attention_mask"].sum() == first["lengths"].sum()
    packed = list(reader.iter_packed(100))
    assert sum(len(p["sample_ids"]) for p in packed) == 6
    assert all(p["input_ids"].shape[1] <= 100 for p in packed)
    p = packed[0]
    assert p["position_ids"][0, int(p["cu_seqlens"][1])] == 0
    assert reader.sample_ids("eval") == [s for s in reader.sample_ids() if reader.read(s).split == "eval"]


# ---- resume, disk, quarantine ---------------------------------------------------------------

def test_resume_after_kill_keeps_finished_shards(tmp_path):
    corpus = make_corpus(tmp_path / "corpus.parquet")
    out = tmp_path / "hs"
    assert [len(b) for b in plan_batches(LENGTHS, 100)] == [2, 2, 2]
    killer = Wrapped(Fake(), fail_after=2)
    with pytest.raises(RuntimeError, match="simulated kill"):
        extract_corpus(corpus, out, killer, shard_bytes=TWO_SAMPLES, batch_tokens=100)
    finished = sorted(out.glob("shard-*.safetensors"))
    assert len(finished) == 1 and not (out / "manifest.json").exists()
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in finished}
    # Debris of a harder crash: a torn progress line and a half-written temp shard.
    with open(out / "progress.jsonl", "a") as fh:
        fh.write('{"kind": "shard", "file": "shard-000')
    (out / ".shard-00007.safetensors.tmp-1").write_bytes(b"partial")

    again = Wrapped(Fake())
    report = extract_corpus(corpus, out, again, shard_bytes=TWO_SAMPLES, batch_tokens=100)
    assert report.shards_kept == 1 and report.already_done == 2 and report.extracted == 4
    assert again.rows == 4  # finished samples were not recomputed
    for name, stat in before.items():
        p = out / name
        assert (p.stat().st_ino, p.stat().st_mtime_ns) == stat
    assert not list(out.glob(".shard-*"))
    index = pl.read_parquet(out / "index.parquet")
    assert index.height == 6 and index["sample_id"].n_unique() == 6
    v = verify_shards(out, corpus)
    assert v.ok, v.problems
    # A finished run re-run is a no-op.
    noop = extract_corpus(corpus, out, Wrapped(Fake()), shard_bytes=TWO_SAMPLES)
    assert noop.extracted == 0 and noop.already_done == 6 and noop.shards_written == 0


def test_refuses_when_disk_is_short(tmp_path, monkeypatch):
    corpus = make_corpus(tmp_path / "corpus.parquet")
    assert sizing.estimate_bytes(1000, H, "bf16", 10) == 1000 * (8 * H + 5) + 10 * 128 + (1 << 20)
    assert sizing.bytes_per_token(H, "fp8") == 4 * H + 8 + 5
    import eagle3_assets.files as files

    real = files.shutil.disk_usage
    monkeypatch.setattr(files.shutil, "disk_usage", lambda p: real(p)._replace(free=100_000))
    out = tmp_path / "hs"
    with pytest.raises(sizing.InsufficientDiskSpace, match=r"need [\d,]+ bytes .* only 100,000 free") as err:
        extract_corpus(corpus, out, Fake())
    assert str(out) in str(err.value)
    assert not list(out.glob("shard-*"))


def test_nan_sample_is_quarantined_not_dropped(extractor, tmp_path):
    corpus = make_corpus(tmp_path / "corpus.parquet", lengths=[20, 38, 15])
    out = tmp_path / "hs"
    report = extract_corpus(corpus, out, Wrapped(extractor, nan_row_len=38), shard_bytes=TWO_SAMPLES)
    assert report.quarantined_new == 1 and report.extracted == 2
    index = pl.read_parquet(out / "index.parquet")
    q = index.filter(pl.col("quarantined"))
    assert q["sample_id"].to_list() == ["s01"] and "non-finite" in q["reason"][0]
    manifest = json.loads((out / "manifest.json").read_text())
    assert [x["sample_id"] for x in manifest["quarantined"]] == ["s01"]
    reader = ShardReader(out)
    assert "s01" not in reader and len(reader) == 2 and reader.quarantined.height == 1
    v = verify_shards(out, corpus)
    assert v.ok and v.quarantined == 1, v.problems


def test_unprefillable_rows_are_quarantined_with_reasons(tmp_path):
    corpus = make_corpus(tmp_path / "corpus.parquet", lengths=[12, 10, 9])
    frame = pl.read_parquet(corpus).with_columns(
        pl.when(pl.col("sample_id") == "s00").then(pl.lit([], pl.List(pl.Int32))).otherwise(pl.col("input_ids"))
        .alias("input_ids"),
        pl.when(pl.col("sample_id") == "s00").then(pl.lit([], pl.List(pl.Int8))).otherwise(pl.col("loss_mask"))
        .alias("loss_mask"),
    ).with_columns(
        pl.when(pl.col("sample_id") == "s01").then(pl.col("input_ids").list.concat(pl.lit([60000], pl.List(pl.Int32))))
        .otherwise(pl.col("input_ids")).alias("input_ids"),
        pl.when(pl.col("sample_id") == "s01").then(pl.col("loss_mask").list.concat(pl.lit([1], pl.List(pl.Int8))))
        .otherwise(pl.col("loss_mask")).alias("loss_mask"),
    )
    frame.write_parquet(corpus)
    report = extract_corpus(corpus, tmp_path / "hs", Fake())
    assert report.quarantined_new == 2 and report.extracted == 1
    reasons = dict(pl.read_parquet(tmp_path / "hs" / "index.parquet").filter(pl.col("quarantined"))
                   .select("sample_id", "reason").iter_rows())
    assert reasons["s00"] == "empty sequence" and "outside the target vocab" in reasons["s01"]
    assert verify_shards(tmp_path / "hs", corpus).ok


def test_verify_catches_corruption(tmp_path):
    corpus = make_corpus(tmp_path / "corpus.parquet", lengths=[20, 21])
    out = tmp_path / "hs"
    extract_corpus(corpus, out, Fake())
    shard = next(out.glob("shard-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    v = verify_shards(out, corpus)
    assert not v.ok and any("sha256" in p for p in v.problems)
    make_corpus(corpus, lengths=[20, 21, 22])  # a sample the shards do not hold
    assert any("neither stored nor quarantined" in p for p in verify_shards(out, corpus).problems)
    make_corpus(corpus, lengths=[20, 23])  # a sample whose corpus row is longer than what was stored: named
    assert "1 samples stored with a length different from the corpus, e.g. ['s01']" in verify_shards(out, corpus).problems


def test_verify_names_the_sample_and_fails_cleanly_on_a_duplicated_corpus(tmp_path):
    corpus = make_corpus(tmp_path / "corpus.parquet", lengths=[20, 21, 22])
    out = tmp_path / "hs"
    extract_corpus(corpus, out, Fake(), shard_bytes=1 << 30)
    [shard] = out.glob("shard-*.safetensors")
    frame = pl.read_parquet(corpus)
    ids = frame["input_ids"].to_list()
    stored = ids[1][5]
    ids[1][5] = stored + 1  # one id of s01 edited in the corpus, its length kept
    frame.with_columns(pl.Series("input_ids", ids, dtype=pl.List(pl.Int32))).write_parquet(corpus)
    assert verify_shards(out, corpus).problems == [
        f"{shard.name}: input_ids of sample s01 differ from the corpus (first at its token 5: {stored} stored, "
        f"{stored + 1} in the corpus)"]
    pl.concat([frame, frame.slice(1, 1)]).write_parquet(corpus)  # a sample twice: a failed check, not a crash
    assert verify_shards(out, corpus).problems == [
        f"the corpus cannot be compared with: {corpus}: 1 duplicate sample rows (s01 x2); the merged corpus must be "
        "unique: re-materialize merged_corpus"]


def test_writer_refuses_other_settings_and_duplicates(tmp_path):
    w = shards.ShardWriter(tmp_path, hidden_size=4, shard_bytes=1 << 20, background=False)
    w.add("a", "train", [1, 2], [0, 1], torch.zeros(2, 12), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="already stored"):
        w.add("a", "train", [1, 2], [0, 1], torch.zeros(2, 12), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="expected aux"):
        w.add("b", "train", [1, 2], [0, 1], torch.zeros(2, 8), torch.zeros(2, 4))
    w.close()
    with pytest.raises(ValueError, match="different settings"):
        shards.ShardWriter(tmp_path, hidden_size=4, dtype="fp8")


# ---- fp8 ----------------------------------------------------------------------------------------

def test_fp8_error_bound_and_size(extractor, tmp_path):
    ids = torch.randint(3, 49152, (41,), generator=torch.Generator().manual_seed(2)).tolist()
    (feat,) = extractor.extract([ids])
    for x in (feat.aux, feat.last):
        q, scale = encoding.quantize_fp8(x)
        assert q.dtype == torch.float8_e4m3fn and scale.shape == (41,)
        back = encoding.dequantize_fp8(q, scale)
        amax = x.abs().amax(dim=-1)
        err = (back - x).abs().amax(dim=-1)
        assert bool((err <= amax / 16).all()), (err / amax).max()
        assert float((err / amax).max()) < 1 / 16
    corpus = make_corpus(tmp_path / "corpus.parquet", lengths=[30, 25])
    r16 = extract_corpus(corpus, tmp_path / "bf16", extractor)
    r8 = extract_corpus(corpus, tmp_path / "fp8", extractor, dtype="fp8")
    assert verify_shards(tmp_path / "fp8", corpus).ok
    assert r8.bytes / r16.bytes == pytest.approx((4 * H + 13) / (8 * H + 5), rel=0.01)
    a, b = ShardReader(tmp_path / "bf16", dtype=torch.float32), ShardReader(tmp_path / "fp8", dtype=torch.float32)
    for sid in a.sample_ids():
        x, y = a.read(sid).aux_hidden, b.read(sid).aux_hidden
        amax = x.abs().amax(dim=-1)
        assert bool(((y - x).abs().amax(dim=-1) <= amax / 16 + amax / 128).all())


# ---- packed captures (SGLang's shape) -----------------------------------------------------------

def test_packed_capture_row_splitting_and_validation():
    h = 4
    packed_aux = torch.arange(5 * 3 * h, dtype=torch.float32).view(5, 3 * h)
    packed_last = torch.arange(5 * h, dtype=torch.float32).view(5, h)
    feats = features_from_packed(packed_aux, packed_last, [2, 3], h)
    assert [tuple(f.aux.shape) for f in feats] == [(2, 12), (3, 12)]
    assert torch.equal(feats[1].last, packed_last[2:])
    assert [t.shape[0] for t in split_packed(packed_last, [1, 4])] == [1, 4]
    with pytest.raises(ValueError, match="hold 5 tokens but the rows add up to 6"):
        split_packed(packed_last, [2, 4])
    with pytest.raises(ValueError, match="aux states"):
        features_from_packed(packed_aux[:, :8], packed_last, [2, 3], h)
