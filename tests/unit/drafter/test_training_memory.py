"""The training step's memory layouts and their estimate, on tiny drafters (seconds, no model).

- micro-batches, recomputed TTT steps and the loss in row chunks give the plain step's loss
  figures and gradients (float tolerance), for both drafter kinds and every objective;
- the estimate of what autograd keeps for backward is checked against the bytes autograd
  actually saves (``saved_tensors_hooks``, storages counted once, weights left out) for several
  shapes, in float32 and under bf16 autocast;
- the plan fits Kimi-K2.5's recipe on 80 and 141 GB devices and refuses, naming the setting,
  where nothing fits; a rank's batch splits into whole samples under the token limit.
"""

import copy

import pytest
import torch

from benchmarks.training_memory import random_batch
from eagle3_assets.drafter.model import DrafterConfig, Eagle3Drafter, build_drafter
from eagle3_assets.drafter.training.config import RuntimeSettings, TrainSettings
from eagle3_assets.drafter.training.loop import Trainer
from eagle3_assets.drafter.training.memory_plan import (
    BatchShape,
    GiB,
    StepMemory,
    activation_bytes,
    attention_kernel,
    autocast_weight_bytes,
    plan_for_run,
    plan_step,
    refusal,
    saved_tensor_bytes,
    split_batch,
)
from eagle3_assets.drafter.training.teacher import Teacher
from tests.unit.drafter.test_drafter_recipe_options import Batches, batch_of, tiny_drafter

MLA = {"q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
       "mscale": 1.0, "mscale_all_dim": 0.0}
KIMI_K25 = {"hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64, "num_key_value_heads": 64,
            "vocab_size": 163840, "num_hidden_layers": 61, "max_position_embeddings": 262144, "rms_norm_eps": 1e-5,
            "rope_theta": 50000.0, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "head_dim": 64,
            "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
                             "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def step_and_grads(model, head, vmap, batch, settings, memory):
    trainer = Trainer(settings, model, Batches([batch]), Teacher(head, vmap), "unused", memory=memory)
    parts = split_batch(batch, memory.micro_batch_tokens)
    m = trainer.train_step(parts if len(parts) > 1 else parts[0])
    return m, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["llama", "mla"])
@pytest.mark.parametrize("loss", ["kl", "lk"])
def test_micro_batches_recomputation_and_loss_chunks_give_the_plain_gradient(kind, loss):
    model, vmap, head = tiny_drafter(**({"attention": "mla", "mla": MLA} if kind == "mla" else {}))
    batch = batch_of([20, 7, 13, 3, 1, 17], head, vmap)
    settings = TrainSettings(max_steps=1, ttt_steps=3, loss=loss, grad_clip=0.0, lr=1e-3)
    plain, g_plain = step_and_grads(copy.deepcopy(model), head, vmap, batch, settings, StepMemory())
    layouts = [StepMemory(micro_batch_tokens=24), StepMemory(checkpoint=True), StepMemory(loss_chunk_rows=5),
               StepMemory(micro_batch_tokens=24, checkpoint=True, loss_chunk_rows=5)]
    for memory in layouts:
        m, g = step_and_grads(copy.deepcopy(model), head, vmap, batch, settings, memory)
        assert m["tokens"] == plain["tokens"] and m["positions"] == plain["positions"], memory
        assert m["loss_per_step"] == pytest.approx(plain["loss_per_step"], rel=1e-5), memory
        assert m["acc_per_step"] == pytest.approx(plain["acc_per_step"], abs=1e-6), memory
        assert g.keys() == g_plain.keys()
        for name, grad in g_plain.items():
            torch.testing.assert_close(g[name], grad, rtol=1e-4, atol=1e-6, msg=lambda s, n=name, m=memory: f"{m} {n}: {s}")


def test_split_batch_keeps_every_sample_once_under_the_limit():
    _, vmap, head = tiny_drafter()
    batch = batch_of([20, 7, 13, 3, 1, 17], head, vmap)
    batch["keys"] = [f"k{i}" for i in range(6)]
    parts = split_batch(batch, 24)
    assert [p["keys"] for p in parts] == [["k0"], ["k1", "k2", "k3", "k4"], ["k5"]]
    for p in parts:
        assert int(p["attention_mask"].sum()) <= 24
        assert p["input_ids"].shape[1] == int(p["attention_mask"].sum(-1).max())
    rows = torch.cat([p["input_ids"][p["attention_mask"] > 0] for p in parts])
    assert torch.equal(rows, batch["input_ids"][batch["attention_mask"] > 0])
    assert split_batch(batch, 0) == [batch] and split_batch(batch, 1000) == [batch]


def saved_bytes(trainer, batch) -> tuple[int, list[int]]:
    """Bytes autograd saves in one forward (weights and buffers left out: they are counted as
    weights), and the rows each TTT step counts."""
    batch = trainer.prepare(batch)
    staged = trainer.stage(batch)
    _, got = saved_tensor_bytes(lambda: trainer.step_sums(batch, staged),
                                exclude=[*trainer.model.parameters(), *trainer.model.buffers()])
    return got, [int(r.numel()) for r in staged[0].logit_rows]


def shaped(h, i, heads, kv, n, mla=None):
    g = torch.Generator().manual_seed(0)
    cfg = DrafterConfig(hidden_size=h, intermediate_size=i, num_attention_heads=heads, num_key_value_heads=kv,
                        head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096, vocab_size=300,
                        draft_vocab_size=n, target_hidden_size=h, aux_layer_ids=[1, 2, 3],
                        attention="mla" if mla else "llama", mla=mla)
    from eagle3_assets.drafter.vocab_map import VocabMap

    ids = torch.sort(torch.randperm(300, generator=g)[:n]).values
    t2d = torch.zeros(300, dtype=torch.bool)
    t2d[ids] = True
    vmap = VocabMap(d2t=ids - torch.arange(n), t2d=t2d, source_hash="synthetic")
    model = build_drafter(cfg, torch.randn(300, h, generator=g), vmap, seed=1)
    return cfg, model, vmap, torch.randn(300, h, generator=g)


SHAPES = [dict(h=32, i=48, heads=4, kv=2, n=64), dict(h=64, i=160, heads=8, kv=8, n=100),
          dict(h=32, i=48, heads=4, kv=4, n=64, mla=MLA),
          dict(h=96, i=200, heads=6, kv=6, n=128, mla={**MLA, "q_lora_rank": 40, "kv_lora_rank": 32})]


# Shapes and batches the estimate's terms were not read off: GQA with one kv head and with three,
# MLA with and without the low-rank query; each batch holds a run of equal lengths, which one
# attention call (and one mask) serves.
UNSEEN = {
    "llama": [(dict(h=40, i=88, heads=5, kv=1, n=72), [220, 220, 90, 31]),
              (dict(h=72, i=144, heads=9, kv=3, n=120), [257, 130, 130, 130])],
    "mla": [(dict(h=56, i=72, heads=7, kv=7, n=60, mla={**MLA, "q_lora_rank": 32, "kv_lora_rank": 20,
                                                        "qk_nope_head_dim": 12, "qk_rope_head_dim": 6, "v_head_dim": 10}),
             [220, 220, 90, 31]),
            (dict(h=40, i=120, heads=5, kv=5, n=90, mla={**MLA, "q_lora_rank": 0, "kv_lora_rank": 28, "qk_nope_head_dim": 8,
                                                         "qk_rope_head_dim": 8, "v_head_dim": 16}),
             [257, 130, 130, 130])],
}


@pytest.mark.parametrize("loss", ["kl", "tv", "nla", "lk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_activation_estimate_against_the_bytes_autograd_saves(kind, dtype, loss):
    """Within 5% of what autograd saves, never more than 2% under, for every objective (tv, nla
    and lk keep the draft probabilities alpha reads, a third float32 block a row)."""
    for shape, lengths in UNSEEN[kind]:
        cfg, model, vmap, head = shaped(**shape)
        settings = TrainSettings(max_steps=1, ttt_steps=3, feature_noise=0.1, loss=loss)
        trainer = Trainer(settings, model, Batches([]), Teacher(head, vmap, dtype=dtype), "unused", compute_dtype=dtype)
        got, rows = saved_bytes(trainer, random_batch(lengths, cfg.hidden_size, head, vmap))
        c = torch.finfo(dtype).bits // 8
        share = sum(rows) / len(rows) / sum(lengths)
        est = activation_bytes(cfg, BatchShape.of(lengths, share), 3, c, StepMemory(), attention_kernel(cfg, "cpu"), e=4,
                               loss=loss)["saved"]
        if c == 2:  # autocast's bf16 copies of the weights, kept for backward
            est += autocast_weight_bytes(cfg)
        assert -0.02 <= est / got - 1 <= 0.05, f"{shape} {lengths}: estimated {est:,} bytes, autograd saved {got:,}"


def test_samples_of_one_length_share_their_mask():
    shape = BatchShape.of([8, 8, 8, 3, 8])
    assert (shape.sum_sq, shape.call_sq, shape.length_sq) == (4 * 64 + 9, 64 + 9 + 64, 64 + 9)
    worst = BatchShape(tokens=40, longest=8)  # lengths unknown: each sample its own call and mask
    assert worst.sum_sq == worst.call_sq == worst.length_sq == 320


def test_recomputed_steps_keep_a_fraction_of_what_the_plain_step_saves():
    cfg, model, vmap, head = shaped(**SHAPES[1])
    batch = random_batch([300, 200], cfg.hidden_size, head, vmap)
    figures = {}
    for memory in (StepMemory(), StepMemory(checkpoint=True, loss_chunk_rows=64)):
        trainer = Trainer(TrainSettings(max_steps=1, ttt_steps=3), model, Batches([]), Teacher(head, vmap), "unused",
                          memory=memory)
        figures[memory.checkpoint] = saved_bytes(trainer, batch)[0]
    assert figures[True] < figures[False] / 4, figures


def kimi_plan(capacity_gb: float, **kw):
    cfg = DrafterConfig.from_target(KIMI_K25, draft_vocab_size=32000, attention="mla")
    return plan_step(cfg, capacity=int(capacity_gb * 1e9 * 0.9), ttt_steps=3, rank_sequences=8, max_length=8192,
                     compute_bytes=2, **kw)


def test_the_kimi_recipe_fits_h100_and_h200_and_what_cannot_fit_is_refused():
    plain = kimi_plan(1e6, fixed=StepMemory())
    assert plain.peak > 141e9  # 8 x 8192 tokens at once: what ran out of memory on an H200
    for gb in (80, 141):
        plan = kimi_plan(gb)
        assert plan.fits() and plan.memory.micro_batch_tokens >= 8192 and plan.memory.loss_chunk_rows > 0, plan.describe()
    assert kimi_plan(141).memory.micro_batch_tokens > kimi_plan(80).memory.micro_batch_tokens
    small = kimi_plan(24)
    assert not small.fits() and small.memory.checkpoint and small.memory.micro_batch_tokens == 8192
    said = refusal(small, max_length=8192, batch_size=64, world_size=8, per_node=8)
    assert "Lower 'batch_size' (now 64: 8 sequences on each of 8 GPUs, 8 per node x 1 node(s))" in said
    assert "'max_length' (now 8,192)" in said and "'nproc_per_node'" in said


def test_the_run_uses_what_the_user_set_and_the_plain_step_on_a_cpu():
    cfg = DrafterConfig.from_target(KIMI_K25, draft_vocab_size=32000, attention="mla")
    training = TrainSettings(max_steps=1, ttt_steps=3, batch_size=64, max_length=8192)
    cpu = plan_for_run(cfg, training, RuntimeSettings(), torch.device("cpu"), world_size=8, compute_bytes=4)
    assert cpu.memory == StepMemory() and cpu.capacity is None
    gpu = plan_for_run(cfg, training, RuntimeSettings(), torch.device("cuda", 0), world_size=8, compute_bytes=2,
                       capacity=int(80e9))  # the capacity given: no device is asked
    assert gpu.fits() and gpu.memory != StepMemory()
    mine = plan_for_run(cfg, training, RuntimeSettings(micro_batch_tokens=8192, activation_checkpointing="on"),
                        torch.device("cuda", 0), world_size=8, compute_bytes=2, capacity=int(80e9))
    assert mine.memory == StepMemory(8192, True, 0)
    with pytest.raises(ValueError, match="below max_length"):
        plan_for_run(cfg, training, RuntimeSettings(micro_batch_tokens=100), torch.device("cpu"), world_size=8,
                     compute_bytes=2)
    assert 1 * GiB < mine.peak < 80e9


def test_build_drafter_on_the_meta_device_draws_what_init_weights_draws():
    model, _, _ = tiny_drafter(seed=3)
    emb = model.embed_tokens.weight.detach().clone()
    old = Eagle3Drafter(model.config).init_weights(3).set_embeddings(emb)
    new = build_drafter(model.config, emb, seed=3)
    assert list(old.state_dict()) == list(new.state_dict())
    for (name, a), b in zip(old.state_dict().items(), new.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(old.rotary.inv_freq, new.rotary.inv_freq)
    half = build_drafter(model.config, emb, seed=3, embed_dtype=torch.bfloat16)
    assert half.embed_tokens.weight.dtype == torch.bfloat16 and half.fc.weight.dtype == torch.float32


def test_the_asset_plans_before_launching_and_refuses_what_cannot_fit():
    from pathlib import Path

    from eagle3_assets.drafter.assets import DrafterTrainingConfig, preflight_memory
    from eagle3_assets.drafter.recipes import parse_recipe
    from eagle3_assets.drafter.training.config import TrainJob
    from eagle3_assets.drafter.training.job import MemoryPlanError
    from eagle3_assets.target.ref import TargetRef

    recipe = parse_recipe(Path(__file__).resolve().parents[3] / "docs" / "recipes" / "kimi-k2.5.toml")
    job = TrainJob(target=TargetRef(model_dir="unused"), out_dir="unused", datasets={}, training=recipe.training,
                   shape=recipe.shape)
    target = {"text_config": {**KIMI_K25}}
    h100 = preflight_memory("kimi-k2.5", job, target, DrafterTrainingConfig(gpu_memory_gib=79.6, nproc_per_node=8))
    assert h100.fits() and h100.memory.micro_batch_tokens == 2 * 8192
    said = (r"recipe kimi-k2.5: the training step does not fit.*'batch_size' \(now 64: 8 sequences on each of 8 GPUs, "
            r"8 per node x 1 node\(s\)\).*'max_length' \(now 8,192\)")
    with pytest.raises(MemoryPlanError, match=said):
        preflight_memory("kimi-k2.5", job, target, DrafterTrainingConfig(gpu_memory_gib=24, nproc_per_node=8))
    if not torch.cuda.is_available():  # no GPU named and none here: each rank plans on its own device
        assert preflight_memory("kimi-k2.5", job, target, DrafterTrainingConfig()) is None


def test_growing_segments_are_for_the_training_only(monkeypatch):
    """Set while training and taken back, so a vLLM server started later does not inherit it."""
    import os

    from eagle3_assets.drafter.training.job import growing_segments

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    with growing_segments():
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    with growing_segments():
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
