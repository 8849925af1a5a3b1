"""The drafter core: vocabulary map, model, training (resume, DDP), exports, speculative decoding.

Features come from the real embedded target (greedy answers to short prompts) and are written
to real hidden-state shards that training streams from; the drafter is tiny (draft vocab
512, intermediate 256) so the whole module stays around a minute on 2 cores. At scale the
same code reads terabytes of shards with a batch of 2048-token rows per rank.
"""

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from eagle3_assets.drafter import formats
from eagle3_assets.drafter.model import DrafterConfig, KVCache, build_drafter
from eagle3_assets.drafter.recipes import RecipeError, list_recipes, load_recipe, parse_recipe
from eagle3_assets.drafter.spec_decode import evaluate_acceptance, greedy_generate, target_features, untrained_baseline
from eagle3_assets.drafter.target_weights import read_target_embeddings, read_target_lm_head
from eagle3_assets.drafter.training.checkpoints import latest_checkpoint, load_checkpoint
from eagle3_assets.drafter.training.config import TrainSettings
from eagle3_assets.drafter.training.data import ShardBatches, ShardDataset, collate
from eagle3_assets.drafter.training.loop import train
from eagle3_assets.drafter.training.teacher import Teacher
from eagle3_assets.drafter.vocab_map import (
    StaleVocabMapError,
    build_vocab_map,
    check_vocab_map,
    count_tokens,
    counts_hash,
    load_or_build_vocab_map,
)
from eagle3_assets.hidden_states.write import write_samples
from eagle3_assets.paths import BUNDLED, REPO_ROOT
from eagle3_assets.target.config import read_config

pytestmark = pytest.mark.model

DRAFT_VOCAB = 512
LAYER_IDS = [1, 14, 26]
QUESTIONS = [f"What is {a}+{b}? Answer with a number only." for a, b in [(2, 3), (7, 5), (10, 4), (6, 9), (12, 8)]] + [
    "Name three colors.", "What is the capital of France?", "Say hello in Spanish.", "List two fruits.",
    "What is water made of?", "Name a large ocean.", "What color is the sky?", "Give me a synonym for happy.",
    "How many legs does a spider have?", "What is the opposite of cold?", "Name a planet.",
    "What do bees make?", "Spell the word cat backwards.", "What is 3 times 4?", "Name a musical instrument.",
]
HELD_OUT = ["What is the capital of Italy?", "Name two animals.", "What is 5+6? Answer with a number only."]
SGLANG_WEIGHTS = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    "norm.weight", "lm_head.weight", "d2t", "t2d",
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Two busy cores run small matmuls far faster with one torch thread than with two."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def corpus(embedded):
    prompts = [embedded.render_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]
    gens = embedded.generate(prompts, max_new_tokens=24)
    seqs = [p + g.output_ids for p, g in zip(prompts, gens)]
    masks = [[0] * len(p) + [1] * len(g.output_ids) for p, g in zip(prompts, gens)]
    return seqs, masks


@pytest.fixture(scope="module")
def features(embedded, corpus):
    return target_features(embedded.model, *corpus, LAYER_IDS)


@pytest.fixture(scope="module")
def target(model_dir):
    return {"config": read_config(model_dir), "embed": read_target_embeddings(model_dir),
            "head": read_target_lm_head(model_dir).float()}


@pytest.fixture(scope="module")
def shard_dir(features, tmp_path_factory):
    """The features as the hidden_states asset stores them (bf16 shards, index, manifest)."""
    out = tmp_path_factory.mktemp("hidden") / "toy"
    write_samples(out, features, layer_ids=LAYER_IDS, num_layers=30, target={"name": "smollm2", "id": "t"},
                  shard_bytes=200_000)
    return out


@pytest.fixture(scope="module")
def dataset(shard_dir):
    return ShardDataset({shard_dir: 1.0}, max_length=64)


@pytest.fixture(scope="module")
def vmap(dataset, target):
    return build_vocab_map(dataset.token_counts(target["config"]["vocab_size"]), DRAFT_VOCAB)


@pytest.fixture(scope="module")
def dcfg(target):
    return DrafterConfig.from_target(target["config"], draft_vocab_size=DRAFT_VOCAB, intermediate_size=256)


@pytest.fixture(scope="module")
def teacher(target, vmap):
    return Teacher(target["head"], vmap)


def small_cfg(**kw) -> TrainSettings:
    base = dict(max_steps=6, batch_size=4, ttt_steps=2, lr=3e-3, warmup_steps=2, checkpoint_every=3,
                max_length=64, feature_noise=0.0)  # exact comparisons (ranks, padding) without noise draws
    return TrainSettings(**{**base, **kw})


@pytest.fixture(scope="module")
def trained(dcfg, target, vmap, dataset, teacher, tmp_path_factory):
    model = build_drafter(dcfg, target["embed"], vmap, seed=0)
    out = tmp_path_factory.mktemp("trained")
    cfg = small_cfg(max_steps=40, ttt_steps=3, warmup_steps=3, checkpoint_every=40)
    result = train(cfg, model, ShardBatches(dataset, 4, seed=0), teacher, out, progress=False)
    return model.eval(), result


# ----------------------------------------------------------------------------- vocabulary map


def test_vocab_map_top_n_ties_and_fill():
    counts = torch.zeros(10, dtype=torch.int64)
    counts[[7, 3, 5, 1]] = torch.tensor([5, 5, 9, 1])
    vm = build_vocab_map(counts, 3)
    assert vm.target_ids.tolist() == [3, 5, 7]  # 5 (9), then the 3-7 tie broken by the lower id first
    assert vm.d2t.dtype == torch.int64 and vm.t2d.dtype == torch.bool
    assert (torch.arange(3) + vm.d2t).tolist() == [3, 5, 7]
    assert vm.t2d.nonzero().flatten().tolist() == [3, 5, 7]
    tie = build_vocab_map(counts, 4)  # 1 (count 1) beats every unseen id
    assert tie.target_ids.tolist() == [1, 3, 5, 7]
    fill = build_vocab_map(counts, 6)  # fewer seen ids than N: the lowest unseen ids fill up
    assert fill.target_ids.tolist() == [0, 1, 2, 3, 5, 7]
    assert build_vocab_map(counts.clone(), 3).source_hash == vm.source_hash


def test_vocab_map_from_data_is_keyed_and_never_stale(features, dataset, vmap, tmp_path):
    v = vmap.target_vocab_size
    counts = count_tokens(((s["input_ids"][:64], s["loss_mask"][:64]) for s in features), v)
    assert torch.equal(counts, dataset.token_counts(v))  # streamed from the shards == counted in memory, as cut
    check_vocab_map(vmap, source_hash=counts_hash(counts), draft_vocab_size=DRAFT_VOCAB, target_vocab_size=v)
    supervised = set(torch.cat([s["input_ids"][:64][s["loss_mask"][:64].bool()] for s in features]).tolist())
    assert len(supervised) < DRAFT_VOCAB and supervised <= set(vmap.target_ids.tolist())
    assert int(vmap.t2d.sum()) == DRAFT_VOCAB

    stored = load_or_build_vocab_map(tmp_path, counts, DRAFT_VOCAB)
    assert (tmp_path / vmap.file_name()).exists() and torch.equal(stored.d2t, vmap.d2t)
    assert torch.equal(load_or_build_vocab_map(tmp_path, counts, DRAFT_VOCAB).t2d, vmap.t2d)  # reused
    other = counts.clone()
    other[int(vmap.target_ids[0])] += 1000  # other data: another key, another file
    rebuilt = load_or_build_vocab_map(tmp_path, other, DRAFT_VOCAB)
    assert rebuilt.source_hash != vmap.source_hash and len(list(tmp_path.glob("vocab_map-*"))) == 2
    with pytest.raises(StaleVocabMapError, match="built from data"):
        check_vocab_map(vmap, source_hash=counts_hash(other))
    with pytest.raises(StaleVocabMapError, match="draft tokens"):
        check_vocab_map(vmap, draft_vocab_size=DRAFT_VOCAB * 2)
    # a file whose contents do not match its key is refused
    (tmp_path / rebuilt.file_name()).replace(tmp_path / vmap.file_name())
    with pytest.raises(StaleVocabMapError):
        load_or_build_vocab_map(tmp_path, counts, DRAFT_VOCAB)


# ----------------------------------------------------------------------------- recipes


def test_recipes_load_and_errors_name_file_and_field(tmp_path):
    assert "demo" in list_recipes()
    demo = load_recipe("demo")
    assert demo.name == "demo" and set(demo.datasets) == {"general", "coding", "math"}
    assert demo.training.epochs and demo.training.max_steps is None
    assert demo.training.ttt_steps >= demo.evaluation.speculative_k
    good = (BUNDLED / "recipes" / "demo.toml").read_text()
    cases = {
        "typo": ("lr = 1e-3\n" + good, "field 'lr'"),  # duplicate key: TOML itself refuses
        "unknown": ("lrate = 1.0\n" + good, "field 'lrate': unknown field"),
        "badtype": (good.replace("batch_size = 4", 'batch_size = "four"'), "field 'batch_size': must be a valid integer"),
        "float": (good.replace("batch_size = 4", "batch_size = 4.5"), "field 'batch_size': must be a valid integer"),
        "range": (good.replace("lr = 3e-3", "lr = -1.0"), "field 'lr': must be greater than 0"),
        "layers": ("aux_layer_ids = [3, 2, 1]\n" + good, "field 'aux_layer_ids': must be three strictly increasing"),
        "both": ("max_steps = 10\n" + good, "field 'max_steps': set exactly one"),
        "weight": (good.replace("math = 1.0", "math = -1"), "field 'datasets.math'"),
        "named": ('name = "other"\n' + good, "field 'name'"),
    }
    for stem, (text, expected) in cases.items():
        path = tmp_path / f"{stem}.toml"
        path.write_text(text)
        with pytest.raises(RecipeError) as err:
            parse_recipe(path)
        assert str(path) in str(err.value)
        if stem != "typo":
            assert expected in str(err.value)
    with pytest.raises(RecipeError, match="no recipe named 'nope'"):
        load_recipe("nope")
    assert demo.training.total_steps(10) == int(demo.training.epochs * 10)


# ----------------------------------------------------------------------------- model


def test_drafter_shapes_names_and_ttt_matches_chain_decoding(dcfg, target, vmap, features):
    model = build_drafter(dcfg, target["embed"], vmap, seed=3).eval()
    h, n = dcfg.hidden_size, DRAFT_VOCAB
    assert set(model.trainable_state_dict()) == SGLANG_WEIGHTS
    assert not model.embed_tokens.weight.requires_grad
    assert model.fc.weight.shape == (h, 3 * h) and model.midlayer.self_attn.q_proj.weight.shape[1] == 2 * h
    s = features[0]
    ids, aux = s["input_ids"][None], s["aux_hidden"][None]
    with torch.no_grad():
        out = model(ids, aux, ttt_steps=3)
        assert [tuple(o.shape) for o in out] == [(1, ids.shape[1], n)] * 3
        # Training-time test == real chain decoding: entries 0..t from target features, then the
        # drafter's own hidden for 2 more tokens at positions t+1, t+2.
        for t in (0, 5, ids.shape[1] - 4):
            cache = KVCache()
            hid = model.step(ids[:, 1: t + 2], model.project_aux(aux[:, : t + 1]), torch.arange(t + 1)[None], cache)
            hid = hid[:, -1:]
            assert torch.allclose(model.logits(hid)[0, 0], out[0][0, t], atol=1e-4)
            for step in (1, 2):
                hid = model.step(ids[:, t + 1 + step: t + 2 + step], hid, torch.tensor([[t + step]]), cache)
                assert torch.allclose(model.logits(hid)[0, 0], out[step][0, t], atol=1e-4)


# ----------------------------------------------------------------------------- training


def test_tiny_training_lowers_the_loss(trained):
    model, result = trained
    first = result.metrics[0]
    last = result.metrics[-5:]
    assert sum(m["loss"] for m in last) / 5 < 0.6 * first["loss"]
    assert sum(m["acc_per_step"][0] for m in last) / 5 > first["acc_per_step"][0] + 0.2
    assert len(first["loss_per_step"]) == len(first["acc_per_step"]) == 3
    assert result.curve_path.stat().st_size > 1000 and result.curve_path.read_bytes()[:4] == b"\x89PNG"
    assert len(json.loads(result.metrics_path.read_text())) == 40
    assert 0 <= result.data_share < 0.5 and result.tokens_per_s > 0


@pytest.mark.parametrize("noise", [0.0, 0.1])
def test_exact_resume(dcfg, target, vmap, dataset, teacher, tmp_path, noise):
    cfg = small_cfg(feature_noise=noise)  # 6 steps over 5 batches per epoch: crosses an epoch boundary
    batches = ShardBatches(dataset, 4, seed=0)
    straight = build_drafter(dcfg, target["embed"], vmap, seed=1)
    a = train(cfg, straight, batches, teacher, tmp_path / "a", progress=False)

    resumed = build_drafter(dcfg, target["embed"], vmap, seed=1)
    crashed = train(cfg, resumed, batches, teacher, tmp_path / "b", stop_after=4, vocab_hash=vmap.source_hash,
                    progress=False)  # dies one step after the step-3 checkpoint
    assert crashed.stopped_early and load_checkpoint(latest_checkpoint(tmp_path / "b"))["step"] == 3
    with pytest.raises(StaleVocabMapError):
        train(cfg, resumed, batches, teacher, tmp_path / "b", vocab_hash="0" * 64, progress=False)
    with pytest.raises(ValueError, match=r"other settings \(lr\)"):
        train(small_cfg(lr=1e-3, feature_noise=noise), resumed, batches, teacher, tmp_path / "b", progress=False)
    fresh = build_drafter(dcfg, target["embed"], vmap, seed=99)  # state comes from the checkpoint only
    b = train(cfg, fresh, batches, teacher, tmp_path / "b", vocab_hash=vmap.source_hash, progress=False)

    assert a.steps == b.steps == 6
    for (name, pa), pb in zip(straight.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert [m["loss"] for m in a.metrics] == [m["loss"] for m in b.metrics]
    assert [m["epoch"] for m in b.metrics] == [0, 0, 0, 0, 0, 1]
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").glob("step-*.pt")) == \
        ["step-00000003.pt", "step-00000006.pt"]


def test_shard_batches_are_global_batches_for_any_world_size_and_start(shard_dir, features):
    """Rank r of N gets every N-th sample of the same global batch; a resumed epoch starts mid-way."""
    mixed = ShardDataset({shard_dir: 1.5}, max_length=40, seed=3)
    assert len(mixed) == 30  # one full copy of the 20 samples + a seeded half
    assert max(int(x["input_ids"].shape[0]) for x in (mixed[i] for i in range(len(mixed)))) == 40  # cut to max_length
    one = ShardBatches(mixed, 6, seed=7)
    two = [ShardBatches(mixed, 6, seed=7, rank=r, world_size=2) for r in range(2)]
    assert len(one) == len(two[0]) == 5
    single = [b["input_ids"] for b in one.epoch(1)]
    for i, per_rank in enumerate(zip(*(t.epoch(1) for t in two))):
        rows = {tuple(r.tolist()) for b in per_rank for r in b["input_ids"]}
        assert rows == {tuple(r.tolist()) for r in single[i]}
    assert [b["input_ids"].tolist() for b in one.epoch(1, start=3)] == [x.tolist() for x in single[3:]]
    assert single[0].tolist() != next(iter(one.epoch(2)))["input_ids"].tolist()  # reshuffled per epoch
    first = mixed[mixed.entries.index((0, "s0000000"))]  # the first sample written (entries: longest first)
    assert first["aux_hidden"].dtype == torch.bfloat16 and first["aux_hidden"].shape[1] == 3 * 576
    torch.testing.assert_close(first["last_hidden"].float(), features[0]["last_hidden"][:40], atol=0.05, rtol=0.01)
    with pytest.raises(ValueError, match="does not divide among 4 ranks"):
        ShardBatches(mixed, 6, world_size=4)


def test_loader_workers_read_the_same_batches(dataset):
    """GPU ranks read shards in DataLoader workers (their own file handles); the batches are the same."""
    inline = [b["aux_hidden"] for b in ShardBatches(dataset, 4, seed=2).epoch(0, start=1)]
    workers = [b["aux_hidden"] for b in ShardBatches(dataset, 4, seed=2, workers=2).epoch(0, start=1)]
    assert len(inline) == len(workers) == 4
    assert all(torch.equal(a, b) for a, b in zip(inline, workers))


def test_bf16_compute_path_trains(dcfg, target, vmap, dataset, tmp_path):
    """The GPU recipe (bf16 autocast, bf16 teacher, fp32 master weights), run on CPU for one step."""
    model = build_drafter(dcfg, target["embed"], vmap, seed=0)
    teacher = Teacher(target["head"], vmap, dtype=torch.bfloat16)
    result = train(small_cfg(max_steps=1, warmup_steps=0), model, ShardBatches(dataset, 4), teacher, tmp_path,
                   compute_dtype=torch.bfloat16, progress=False)
    assert result.steps == 1 and all(math.isfinite(m["loss"]) and m["positions"][0] > 0 for m in result.metrics)
    assert model.fc.weight.dtype == torch.float32 and teacher.head.dtype == torch.bfloat16


def test_training_refuses_layers_the_shards_do_not_hold_and_bad_job_files(model_dir, dataset, tmp_path, capsys):
    from eagle3_assets.drafter.training.__main__ import main
    from eagle3_assets.drafter.training.config import DraftShape, TrainJob
    from eagle3_assets.drafter.training.job import drafter_config
    from eagle3_assets.target.ref import TargetRef

    job = TrainJob(target=TargetRef(model_dir=str(model_dir)), out_dir=str(tmp_path), datasets={"unused": 1.0},
                   training=small_cfg(), shape=DraftShape(draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=[2, 14, 26]))
    with pytest.raises(ValueError, match=r"asks for aux layers \[2, 14, 26\] but the hidden states hold \[1, 14, 26\]"):
        drafter_config(job, dataset)
    default = job.model_copy(update={"shape": DraftShape(draft_vocab_size=DRAFT_VOCAB)})
    assert drafter_config(default, dataset).aux_layer_ids == LAYER_IDS  # read from the manifest
    raw = json.loads(job.model_dump_json())
    raw["training"]["lr"] = "fast"
    bad = tmp_path / "job.json"
    bad.write_text(json.dumps(raw))
    assert main(["--config", str(bad)]) == 2
    assert f"{bad}: field 'training.lr'" in capsys.readouterr().err


def test_the_trainer_entry_refuses_a_step_no_layout_fits_with_status_2(model_dir, shard_dir, tmp_path, monkeypatch, capsys):
    """A device too small for even one sequence, recomputed, with the loss in chunks: the entry
    prints one line naming the batch, the GPUs and the lengths, exits 2, and trains nothing."""
    from eagle3_assets.drafter.training import memory_plan
    from eagle3_assets.drafter.training.__main__ import main
    from eagle3_assets.drafter.training.config import DraftShape, RuntimeSettings, TrainJob
    from eagle3_assets.target.ref import TargetRef

    job = TrainJob(target=TargetRef(model_dir=str(model_dir)), out_dir=str(tmp_path / "out"), datasets={str(shard_dir): 1.0},
                   training=small_cfg(), shape=DraftShape(draft_vocab_size=DRAFT_VOCAB, intermediate_size=256),
                   runtime=RuntimeSettings(threads=1, progress=False)).write(tmp_path / "job.json")
    monkeypatch.setattr(memory_plan, "device_capacity", lambda device: 64 << 20)  # a 64 MiB device
    assert main(["--config", str(job)]) == 2
    [err] = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert err.startswith(f"error: {job}: the training step does not fit: estimated peak")
    assert "of 0.1 GiB usable" in err
    assert "Lower 'batch_size' (now 4: 4 sequences on each of 1 GPUs, 1 per node x 1 node(s))" in err
    assert "'max_length' (now 64)" in err and "'nproc_per_node'" in err
    assert not list((tmp_path / "out").glob("checkpoint*")) and not (tmp_path / "out" / "result.json").exists()


def test_the_trainer_refuses_a_shard_whose_bytes_changed_before_reading_it(model_dir, shard_dir, tmp_path, capsys):
    """A shard's bytes changed at the same size (bit rot, a bad copy): the trainer checks every shard
    against its manifest's sha256 first, and exits 2 naming it and what to re-materialize."""
    import shutil

    from eagle3_assets.drafter.training.__main__ import main
    from eagle3_assets.drafter.training.config import DraftShape, RuntimeSettings, TrainJob
    from eagle3_assets.target.ref import TargetRef

    rotten = tmp_path / "toy"
    shutil.copytree(shard_dir, rotten)
    shard = sorted(rotten.glob("shard-*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # in the last token's states: every tensor still loads, one value is other
    shard.write_bytes(bytes(data))
    job = TrainJob(target=TargetRef(model_dir=str(model_dir)), out_dir=str(tmp_path / "out"), datasets={str(rotten): 1.0},
                   training=small_cfg(), shape=DraftShape(draft_vocab_size=DRAFT_VOCAB, intermediate_size=256),
                   runtime=RuntimeSettings(threads=1, progress=False)).write(tmp_path / "job.json")
    assert main(["--config", str(job)]) == 2
    assert [line for line in capsys.readouterr().err.splitlines() if "error" in line] == [
        f"error: {job}: 1 shard(s) differ from their manifest: {shard}: its sha256 is not the one the manifest records "
        "(its bytes changed after extraction): re-materialize hidden_states[toy]"]
    assert not (tmp_path / "out" / "result.json").exists()


def test_padding_does_not_change_real_positions(dcfg, target, vmap, features):
    """Fused attention on a right-padded batch gives each sample its own unpadded result."""
    model = build_drafter(dcfg, target["embed"], vmap, seed=5).eval()
    batch = collate(features[:3])
    with torch.no_grad():
        padded = model(batch["input_ids"], batch["aux_hidden"], batch["attention_mask"], ttt_steps=3)
        for i, s in enumerate(features[:3]):
            n = s["input_ids"].shape[0]
            alone = model(s["input_ids"][None], s["aux_hidden"][None], ttt_steps=3)
            for step in range(3):
                torch.testing.assert_close(padded[step][i, :n], alone[step][0], atol=1e-4, rtol=1e-4)
        with pytest.raises(ValueError, match="right padding"):
            model(batch["input_ids"], batch["aux_hidden"], batch["attention_mask"].flip(-1), ttt_steps=1)


def _pipes_env(tmp_path: Path) -> tuple[dict, Path]:
    from dagster_pipes import encode_env_var

    messages = tmp_path / "pipes-messages.jsonl"
    context = {"asset_keys": ["drafter_checkpoint"], "code_version_by_asset_key": None,
               "provenance_by_asset_key": None, "partition_key": "demo", "partition_key_range": None,
               "partition_time_window": None, "run_id": "test-run", "job_name": None, "retry_number": 0,
               "extras": {}}
    env = {"DAGSTER_PIPES_CONTEXT": encode_env_var({"data": context}),
           "DAGSTER_PIPES_MESSAGES": encode_env_var({"path": str(messages)})}
    return env, messages


def test_torchrun_two_processes_match_one_and_report_through_pipes(model_dir, shard_dir, features, tmp_path):
    from eagle3_assets.drafter.training.config import DraftShape, ExportSettings, RuntimeSettings, TrainJob
    from eagle3_assets.target.ref import TargetRef

    held_out = tmp_path / "held_out"  # a dataset of held-out samples only: the acceptance estimate's
    write_samples(held_out, features[:8], layer_ids=LAYER_IDS, num_layers=30, target={"name": "smollm2", "id": "t"},
                  split="eval")
    jobs = {}
    for name in ("single", "ddp"):
        jobs[name] = TrainJob(
            target=TargetRef(model_dir=str(model_dir)), datasets={str(shard_dir): 1.0, str(held_out): 1.0},
            out_dir=str(tmp_path / name),
            training=small_cfg(max_steps=3, warmup_steps=1), shape=DraftShape(draft_vocab_size=DRAFT_VOCAB,
                                                                                intermediate_size=256),
            runtime=RuntimeSettings(threads=1, progress=False),
            export=ExportSettings(engines=("sglang",)) if name == "single" else None,
        ).write(tmp_path / f"{name}.json")
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_PIPES")}
    pipes_env, messages = _pipes_env(tmp_path)
    module = ["-m", "eagle3_assets.drafter.training", "--config"]
    procs = {
        "single": subprocess.Popen([sys.executable, *module, str(jobs["single"])], env={**base_env, **pipes_env},
                                   cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
        "ddp": subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                 *module, str(jobs["ddp"])],
                                env={**base_env, "OMP_NUM_THREADS": "1"}, cwd=REPO_ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
    }
    for name, p in procs.items():
        out, _ = p.communicate(timeout=1800)
        assert p.returncode == 0, f"{name} failed:\n{out[-3000:]}"

    single, ddp = (json.loads((tmp_path / n / "result.json").read_text()) for n in ("single", "ddp"))
    assert (single["world_size"], ddp["world_size"], single["steps"], ddp["steps"]) == (1, 2, 3, 3)
    assert single["vocab_map"] == ddp["vocab_map"]
    sa = load_checkpoint(latest_checkpoint(tmp_path / "single"))
    sb = load_checkpoint(latest_checkpoint(tmp_path / "ddp"))
    for name, pa in sa["model"].items():
        # Adam moves each weight by up to ~lr per step; float reduction order must stay far below that.
        assert torch.allclose(pa.float(), sb["model"][name].float(), rtol=1e-4, atol=1e-4), name
    for ma, mb in zip(sa["metrics"], sb["metrics"]):
        assert ma["tokens"] == mb["tokens"] and ma["positions"] == mb["positions"]
        assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-4)
    assert (Path(single["sglang_dir"]) / "model.safetensors").exists()
    # the estimate at the one checkpoint, the two ranks' counts summed: the same held-out chains
    [ea], [eb] = single["acceptance_estimates"], ddp["acceptance_estimates"]
    assert (ea["step"], ea["samples"]) == (eb["step"], eb["samples"]) == (3, 8) and ea["chain_starts"] == eb["chain_starts"] > 0
    assert ea["eal"] == pytest.approx(eb["eal"], abs=0.02) and (single["eal_best_step"], single["exported_step"]) == (3, 3)

    sent = [json.loads(line) for line in messages.read_text().splitlines()]
    methods = [m["method"] for m in sent]
    assert methods[0] == "opened" and methods[-1] == "closed" and "log" in methods
    [mat] = [m for m in sent if m["method"] == "report_asset_materialization"]
    meta = mat["params"]["metadata"]
    assert meta["steps"]["raw_value"] == 3 and meta["world_size"]["raw_value"] == 1
    assert meta["eal_best"]["raw_value"] == single["eal_best"] and meta["exported_step"]["raw_value"] == 3
    assert any("acceptance estimate EAL" in m["params"]["message"] for m in sent if m["method"] == "log")


# ----------------------------------------------------------------------------- exports


def test_sglang_export_layout(trained, target, tmp_path):
    from safetensors import safe_open

    model, _ = trained
    cfg = model.config
    out = formats.export("sglang", model, tmp_path / "sglang", dtype="bfloat16")
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["model_type"] == "llama"
    assert c["num_hidden_layers"] == 1 and c["draft_vocab_size"] == DRAFT_VOCAB
    tc = target["config"]
    assert (c["vocab_size"], c["max_position_embeddings"], c["hidden_size"]) == \
        (tc["vocab_size"], tc["max_position_embeddings"], tc["hidden_size"])
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]) == (9, 3, 256)
    assert c["rope_theta"] == tc["rope_parameters"]["rope_theta"] and "rope_scaling" in c
    assert c["rms_norm_eps"] == tc["rms_norm_eps"] and c["torch_dtype"] == "bfloat16"
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == LAYER_IDS
    h, i, n, v = cfg.hidden_size, 256, DRAFT_VOCAB, tc["vocab_size"]
    shapes = {"fc.weight": (h, 3 * h), "midlayer.self_attn.q_proj.weight": (9 * 64, 2 * h),
              "midlayer.self_attn.k_proj.weight": (3 * 64, 2 * h), "midlayer.self_attn.v_proj.weight": (3 * 64, 2 * h),
              "midlayer.self_attn.o_proj.weight": (h, 9 * 64), "midlayer.mlp.gate_proj.weight": (i, h),
              "midlayer.mlp.up_proj.weight": (i, h), "midlayer.mlp.down_proj.weight": (h, i),
              "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
              "midlayer.post_attention_layernorm.weight": (h,), "norm.weight": (h,), "lm_head.weight": (n, h),
              "d2t": (n,), "t2d": (v,)}
    with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
        assert set(fh.keys()) == SGLANG_WEIGHTS  # no embed_tokens
        for k in fh.keys():
            t = fh.get_tensor(k)
            assert tuple(t.shape) == shapes[k], k
            assert t.dtype == {"d2t": torch.int64, "t2d": torch.bool}.get(k, torch.bfloat16), k
        assert int(fh.get_tensor("t2d").sum()) == n
        assert torch.equal(fh.get_tensor("d2t") + torch.arange(n), model.d2t + torch.arange(n))


def test_vllm_export_layout(trained, model_dir, tmp_path):
    from safetensors import safe_open

    model, _ = trained
    out = formats.export("vllm", model, tmp_path / "vllm", dtype="bfloat16", verifier=str(model_dir), speculative_tokens=3)
    c = json.loads((out / "config.json").read_text())
    assert c["speculators_model_type"] == "eagle3" and c["architectures"] == ["Eagle3Speculator"]
    assert c["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in LAYER_IDS]  # vLLM numbering
    assert not any(c[f] for f in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"))
    assert c["transformer_layer_config"]["num_hidden_layers"] == 1
    sc = c["speculators_config"]
    assert sc["proposal_methods"][0]["speculative_tokens"] == 3
    assert sc["verifier"]["architectures"] == ["LlamaForCausalLM"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
        keys = set(fh.keys())
    expected = {k.replace("midlayer.", "layers.0.") for k in SGLANG_WEIGHTS} | {"embed_tokens.weight"}
    assert keys == expected


def test_exports_load_in_a_fresh_process(trained, features, model_dir, tmp_path):
    from safetensors.torch import save_file

    model, _ = trained
    formats.export("sglang", model, tmp_path / "sglang", dtype="float32")
    formats.export("vllm", model, tmp_path / "vllm", dtype="float32", verifier=str(model_dir))
    s = features[1]
    with torch.no_grad():
        expected = model(s["input_ids"][None], s["aux_hidden"][None], ttt_steps=3)
    save_file({"input_ids": s["input_ids"][None].contiguous(), "aux": s["aux_hidden"][None].contiguous(),
               **{f"out{i}": o.contiguous() for i, o in enumerate(expected)}}, str(tmp_path / "io.safetensors"))
    script = textwrap.dedent(f"""
        import torch
        from safetensors.torch import load_file
        from eagle3_assets.drafter import formats
        from eagle3_assets.drafter.target_weights import read_target_embeddings
        io = load_file({str(tmp_path / 'io.safetensors')!r})
        models = {{"sglang": formats.load("sglang", {str(tmp_path / 'sglang')!r}, read_target_embeddings({str(model_dir)!r})),
                   "vllm": formats.load("vllm", {str(tmp_path / 'vllm')!r})}}
        for name, m in models.items():
            with torch.no_grad():
                out = m(io["input_ids"], io["aux"], ttt_steps=3)
            for i, o in enumerate(out):
                assert torch.equal(o, io[f"out{{i}}"]), (name, i, (o - io[f"out{{i}}"]).abs().max())
            print(name, "ok")
    """)
    res = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["sglang", "ok", "vllm", "ok"]
    # the loaders also refuse what they cannot serve faithfully
    cfg_path = tmp_path / "vllm" / "config.json"
    c = json.loads(cfg_path.read_text())
    del c["norm_before_residual"]  # vLLM would default it to True
    cfg_path.write_text(json.dumps(c))
    with pytest.raises(ValueError, match="norm_before_residual"):
        formats.load("vllm", tmp_path / "vllm")


# ----------------------------------------------------------------------------- speculative decoding


def test_speculative_decoding_equals_greedy(trained, embedded):
    model, _ = trained
    prompts = [embedded.render_prompt([{"role": "user", "content": q}]) for q in HELD_OUT[:2]] + \
        [embedded.render_prompt([{"role": "user", "content": QUESTIONS[5]}])]  # one seen in training
    greedy = [greedy_generate(embedded.model, p, max_new_tokens=16, stop_ids=embedded.stop_ids) for p in prompts]
    reports = {}
    for name, drafter in (("trained", model), ("untrained", untrained_baseline(model, seed=0))):
        rep = evaluate_acceptance(embedded.model, drafter, prompts, k=3, max_new_tokens=16,
                                  stop_ids=embedded.stop_ids, greedy_reference=greedy)
        assert rep.matches_greedy, (name, rep.outputs, greedy)
        assert rep.acceptance_length == pytest.approx(1 + rep.acceptance_length_no_bonus)
        assert sum(rep.accepted_histogram) == rep.verify_steps > 0
        assert rep.per_position_rate == sorted(rep.per_position_rate, reverse=True)
        assert 1 <= rep.tokens_per_verification <= rep.acceptance_length + 1e-9
        reports[name] = rep
    assert reports["trained"].outputs == reports["untrained"].outputs
    assert reports["trained"].acceptance_length > reports["untrained"].acceptance_length


def test_replay_acceptance_equals_chain_decoding(trained, embedded):
    """The replay (one prefill + one TTT pass) walks the real decoder's verification steps,
    prompt by prompt, for a trained and an untrained drafter."""
    from eagle3_assets.drafter.replay_acceptance import replay_acceptance, replay_inputs, replay_one
    from eagle3_assets.drafter.spec_decode import speculative_generate

    model, _ = trained
    prompts = [embedded.render_prompt([{"role": "user", "content": q}]) for q in [*HELD_OUT, *QUESTIONS[:3]]]
    stops = embedded.stop_ids
    for n in (4, 16):  # replies cut by length, and replies that end on a stop token
        greedy = [greedy_generate(embedded.model, p, max_new_tokens=n, stop_ids=stops) for p in prompts]
        items = replay_inputs(embedded.model, prompts, greedy, model.config.aux_layer_ids, lookahead=3)
        assert sum(it.greedy_mismatches for it in items) == 0
        for drafter in (model, untrained_baseline(model, seed=0)):
            for p, it in zip(prompts, items):
                real = speculative_generate(embedded.model, drafter, p, k=3, max_new_tokens=n, stop_ids=stops)
                fast = replay_one(drafter, it, k=3, max_new_tokens=n, stop_ids=stops)
                assert (fast.accepted, fast.emitted, fast.output_ids, fast.finish_reason) == \
                    (real.accepted, real.emitted, real.output_ids, real.finish_reason)
        rep = replay_acceptance(model, items, k=3, max_new_tokens=n, stop_ids=stops)
        assert rep.matches_greedy and rep.verify_steps > 0
    assert {r.finish_reason for r in (fast, real)} <= {"stop", "length"}
    assert rep.acceptance_length > replay_acceptance(untrained_baseline(model, seed=0), items, k=3, max_new_tokens=n,
                                                     stop_ids=stops).acceptance_length


def test_near_tie_mask_is_a_few_float32_units_in_the_last_place():
    from eagle3_assets.drafter.spec_decode import TIE_ULPS, near_tie_mask

    ulp = float(torch.finfo(torch.float32).eps) * 4  # one unit in the last place between 4 and 8
    rows = torch.tensor([[4.0, 4.0 - 2 * ulp, 0.0],  # the kimi-mini MLA drafter's tie: two units apart
                         [4.0, 4.0 - (TIE_ULPS + 1) * ulp, 0.0],
                         [4.0, 3.99, 0.0],
                         [0.0, -1e-7, -1.0]])  # near zero the unit is that of 1.0
    assert near_tie_mask(rows).tolist() == [True, False, False, True]
    assert near_tie_mask(rows[2:3].bfloat16()).tolist() == [True]  # bf16 logits: its own units


def test_settling_a_tie_the_other_way_drafts_the_other_of_the_two_best_even_when_they_are_equal():
    from eagle3_assets.drafter.spec_decode import draft_index

    for row in (torch.tensor([0.0, 4.0, 4.0, 1.0]), torch.tensor([4.0, 0.0, 1.0, 4.0 - 4.8e-7])):
        ties: list[int] = []
        plain = int(draft_index(row, 5, ties, frozenset()))
        other = int(draft_index(row, 5, ties, frozenset({5})))
        assert ties == [5, 5] and plain == int(row.argmax()) and other != plain and row[other] >= row.max() - 1e-6
    ties = []
    assert int(draft_index(torch.tensor([4.0, 3.0]), 0, ties, frozenset({0}))) == 0 and ties == []  # no tie: no flip


def test_a_near_tie_is_recorded_and_settled_as_a_drafter_preferring_the_runner_up_decodes(trained, embedded):
    """The decoder records a draft whose two best logits are a near-tie; settling it for the runner-up
    (``flips``) decodes exactly as a drafter whose logits rank the runner-up first there (the other
    token drafted without the flip machinery); ``tie_outcomes`` lists both; outputs stay greedy."""
    from eagle3_assets.drafter.spec_decode import speculative_generate, tie_outcomes

    model, _ = trained
    prompt = embedded.render_prompt([{"role": "user", "content": HELD_OUT[0]}])
    run = dict(k=3, max_new_tokens=16, stop_ids=embedded.stop_ids)
    plain = speculative_generate(embedded.model, model, prompt, **run)
    assert plain.ties == []
    step = next(i for i, a in enumerate(plain.accepted) if a > 0)  # a step whose first draft was accepted
    call = step * 3  # the decoder drafts k tokens per step, every step

    logits, seen = type(model).logits.__get__(model), []

    def recording(h):
        seen.append(h)
        return logits(h)

    def rigged(runner_up_above: bool):
        """``model.logits`` with the runner-up one unit below the best, or above it, on the state
        the plain decode drafted from at ``call`` (keyed on the state: every decode that reaches it)."""
        def fn(h):
            z = logits(h)
            if torch.equal(h, seen[call]):
                z = z.clone()
                best, second = z[0, -1].topk(2).indices.tolist()
                top = z[0, -1, best]
                z[0, -1, second] = top + 1.0 if runner_up_above else torch.nextafter(top, top.new_tensor(-1e9))
            return z
        return fn

    model.logits = recording
    try:
        speculative_generate(embedded.model, model, prompt, **run)
        model.logits = rigged(False)
        tied = speculative_generate(embedded.model, model, prompt, **run)
        flipped = speculative_generate(embedded.model, model, prompt, flips=frozenset({call}), **run)
        outcomes = tie_outcomes(embedded.model, model, prompt, **run)
        model.logits = rigged(True)
        other = speculative_generate(embedded.model, model, prompt, **run)
    finally:
        del model.logits
    assert tied.ties == [call] and tied.accepted == plain.accepted
    assert flipped.accepted[step] < plain.accepted[step]  # the runner-up is not the target's token
    assert (flipped.accepted, flipped.emitted, flipped.output_ids) == (other.accepted, other.emitted, other.output_ids)
    assert flipped.output_ids == plain.output_ids  # verification keeps the output greedy
    assert [o.accepted for o in outcomes] == [plain.accepted, flipped.accepted]


def test_acceptance_estimate_counts_the_chains_the_replay_evaluator_finds(trained, features, teacher, tmp_path):
    """The trainer's estimate (packed batches, the teacher's argmax on the stored final states) against
    an independent record: the replay evaluator's accepted length at every position of each sample (its
    padded TTT forward, the sample's own next tokens as the truth), tallied here by a bare loop."""
    from eagle3_assets.drafter.replay_acceptance import ReplayInput, accepted_lengths
    from eagle3_assets.drafter.training.data import eval_split
    from eagle3_assets.drafter.training.loop import Trainer

    model, _ = trained
    k, held = 3, tmp_path / "held_out"
    write_samples(held, features, layer_ids=LAYER_IDS, num_layers=30, target={"name": "smollm2", "id": "t"}, split="eval")
    samples = eval_split({held: 1.0}, max_length=64, samples=8)
    batches = ShardBatches(samples, 4, shuffle=False)
    trainer = Trainer(small_cfg(ttt_steps=k), model, batches, teacher, tmp_path, progress=False, eval_data=batches, eal_k=k)
    est = trainer.estimate_acceptance()

    starts, chains, accepted = [0] * k, [0] * k, [0] * k
    for i in range(len(samples)):
        x = samples[i]
        ids, mask, n = x["input_ids"], x["loss_mask"].tolist(), len(x["input_ids"])
        # the replies are the target's greedy ones: its argmax on the stored states is the next token
        argmax = teacher.target_ids(x["last_hidden"].float())
        assert all(argmax[t] == ids[t + 1] for t in range(n - 1) if mask[t + 1])
        a = accepted_lengths(model, ReplayInput(0, 0, ids, x["aux_hidden"].float(), 0), k)
        for r in range(n):
            for s in range(k):
                if r + 2 + s < n and all(mask[r + 2: r + 3 + s]):  # s + 1 drafts, all on reply tokens
                    starts[s] += 1
                    chains[s] += a[r] >= s
                    accepted[s] += a[r] >= s + 1
    rates = [x / c for x, c in zip(accepted, chains)]
    assert rates[-1] > 0  # chains of every length were accepted somewhere: the test reaches the last position
    assert (est["samples"], est["chain_starts"], est["k"]) == (8, starts[0], k)
    assert est["acceptance_rate"] == rates
    assert est["eal"] == pytest.approx(1 + rates[0] + rates[0] * rates[1] + rates[0] * rates[1] * rates[2])
    assert est["accuracy"][0] == est["acceptance_rate"][0]  # the first draft has no draft before it

