"""The drafter's training and export on a CUDA GPU (marked ``gpu``: skipped without one, CI too).

- a training step on the GPU equals the same step on the CPU (float32: loss figures, gradients);
- under bf16 autocast, micro-batches, recomputed TTT steps and loss chunks give the plain step's
  gradients (bf16 tolerance) on the GPU as on the CPU;
- the memory estimate against ``torch.cuda.max_memory_allocated`` over whole steps;
- an export's logits on the GPU equal the CPU's.
"""

import copy

import pytest
import torch

from eagle3_assets.drafter import formats
from eagle3_assets.drafter.training.config import TrainSettings
from eagle3_assets.drafter.training.loop import Trainer
from eagle3_assets.drafter.training.memory_plan import StepMemory, split_batch
from eagle3_assets.drafter.training.teacher import Teacher
from tests.unit.drafter.test_drafter_recipe_options import Batches, batch_of, tiny_drafter

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def one_step(model, head, vmap, batch, settings, memory=None, device="cpu", dtype=torch.float32):
    memory = memory or StepMemory()
    model = copy.deepcopy(model).to(device)
    trainer = Trainer(settings, model, Batches([]), Teacher(head, vmap, device=device, dtype=dtype), "unused",
                      compute_dtype=dtype, memory=memory)
    parts = [trainer.prepare(p) for p in split_batch(batch, memory.micro_batch_tokens)]
    m = trainer.train_step(parts if len(parts) > 1 else parts[0])
    return m, {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}


def test_a_step_on_the_gpu_equals_the_cpus():
    model, vmap, head = tiny_drafter()
    batch = batch_of([20, 7, 13, 3], head, vmap)
    settings = TrainSettings(max_steps=1, ttt_steps=3, grad_clip=0.0, feature_noise=0.0)
    cpu, g_cpu = one_step(model, head, vmap, batch, settings)
    gpu, g_gpu = one_step(model, head, vmap, batch, settings, device=CUDA)
    assert gpu["positions"] == cpu["positions"]
    assert gpu["loss_per_step"] == pytest.approx(cpu["loss_per_step"], rel=1e-4)
    for name, g in g_cpu.items():
        torch.testing.assert_close(g_gpu[name], g, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_memory_layouts_keep_the_bf16_gradient_on_the_gpu(kind):
    mla = {"q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
           "mscale": 1.0, "mscale_all_dim": 0.0}
    model, vmap, head = tiny_drafter(**({"attention": "mla", "mla": mla} if kind == "mla" else {}))
    batch = batch_of([20, 7, 13, 3, 1, 17], head, vmap)
    settings = TrainSettings(max_steps=1, ttt_steps=3, grad_clip=0.0, feature_noise=0.0)
    plain, g_plain = one_step(model, head, vmap, batch, settings, device=CUDA, dtype=torch.bfloat16)
    m, g = one_step(model, head, vmap, batch, settings, StepMemory(24, True, 5), device=CUDA, dtype=torch.bfloat16)
    assert m["loss_per_step"] == pytest.approx(plain["loss_per_step"], rel=2e-2)
    for name, grad in g_plain.items():
        torch.testing.assert_close(g[name], grad, rtol=5e-2, atol=1e-3, msg=name)


def test_the_memory_estimate_against_peak_allocated():
    from benchmarks.training_memory import LLAMA8B, gpu_row

    for memory in (StepMemory(), StepMemory(2048, True, 1024)):
        row = gpu_row("llama-8b", LLAMA8B, attention="llama", sequences=4, length=1024, vocab=32000, draft_vocab=8192,
                      memory=memory)
        assert abs(row["error"]) < 0.25, row


def test_export_logits_on_the_gpu_equal_the_cpus(tmp_path):
    model, vmap, head = tiny_drafter()
    out = formats.export("sglang", model, tmp_path / "sglang", dtype="float32")
    emb = model.embed_tokens.weight.detach()
    cpu, gpu = formats.load("sglang", out, emb).eval(), formats.load("sglang", out, emb).to(CUDA).eval()
    batch = batch_of([16], head, vmap)
    with torch.no_grad():
        a = cpu(batch["input_ids"], batch["aux_hidden"], ttt_steps=2)
        b = gpu(batch["input_ids"].to(CUDA), batch["aux_hidden"].to(CUDA), ttt_steps=2)
    for x, y in zip(a, b):
        torch.testing.assert_close(y.cpu(), x, rtol=1e-4, atol=1e-4)
