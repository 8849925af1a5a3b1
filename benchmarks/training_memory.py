"""The training step's memory estimate (``drafter/training/memory_plan.py``) against measurement.

On a CPU the record is what autograd saves for backward: every storage its ``saved_tensors_hooks``
see in one forward of the trainer's step, counted once, weights left out, against the estimate's
``saved`` part, for several drafter shapes and lengths (each batch with a run of equal lengths),
every objective (kl, tv, nla, lk), float32 and bf16 autocast, Kimi-K2.5's
own MLA shape among them at a reduced length (its vocabulary cut to 32,000: the vocabulary sizes
only the frozen embedding and the teacher's heads, counted exactly as weights, not activations).

On a GPU (``--gpu``) the record is ``torch.cuda.max_memory_allocated`` over a whole step
(forward, backward, optimizer) against the estimate's peak, for the layouts the plan picks.

Then the plan for Kimi-K2.5's bundled recipe (8 x 8,192 tokens per GPU, 3 TTT steps) on an
H100 (79.6 GiB) and an H200 (139.7 GiB).

    .venv/bin/python benchmarks/training_memory.py [--gpu] [--no-record]
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from eagle3_assets.drafter.model import DrafterConfig, build_drafter  # noqa: E402
from eagle3_assets.drafter.training.config import TrainSettings  # noqa: E402
from eagle3_assets.drafter.training.loop import Trainer  # noqa: E402
from eagle3_assets.drafter.training.memory_plan import (  # noqa: E402
    BatchShape,
    GiB,
    StepMemory,
    activation_bytes,
    attention_kernel,
    autocast_weight_bytes,
    estimate_step,
    plan_step,
    saved_tensor_bytes,
)
from eagle3_assets.drafter.training.teacher import Teacher  # noqa: E402
from eagle3_assets.drafter.vocab_map import VocabMap  # noqa: E402

KIMI = {"hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64, "num_key_value_heads": 64,
        "num_hidden_layers": 61, "max_position_embeddings": 262144, "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "head_dim": 64, "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                                         "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}}
SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
           "head_dim": 64, "num_hidden_layers": 30, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
           "rope_theta": 100000.0}
LLAMA8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 128, "num_hidden_layers": 32, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0}
H100, H200 = int(79.6 * GiB), int(139.7 * GiB)
LOSSES = ("kl", "tv", "nla", "lk")


class _Batches:
    def __init__(self, batches):
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def epoch(self, epoch, start=0):
        yield from self.batches[start:]


def drafter(text: dict, *, vocab: int, draft_vocab: int, attention: str, device: str = "cpu"):
    cfg = DrafterConfig.from_target({**text, "vocab_size": vocab}, draft_vocab_size=draft_vocab, attention=attention)
    g = torch.Generator().manual_seed(0)
    ids = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    vmap = VocabMap(d2t=ids - torch.arange(draft_vocab), t2d=t2d, source_hash="synthetic")
    emb = torch.randn(vocab, cfg.hidden_size, generator=g) * 0.02
    model = build_drafter(cfg, emb, vmap, device=device, seed=1)
    return cfg, model, vmap, torch.randn(vocab, cfg.hidden_size, generator=g) * 0.02


def random_batch(lengths: list[int], h: int, head: torch.Tensor, vmap: VocabMap) -> dict:
    g = torch.Generator().manual_seed(0)
    b, t = len(lengths), max(lengths)
    out = {"input_ids": torch.zeros(b, t, dtype=torch.long), "loss_mask": torch.zeros(b, t, dtype=torch.long),
           "attention_mask": torch.zeros(b, t, dtype=torch.long), "aux_hidden": torch.zeros(b, t, 3 * h),
           "last_hidden": torch.zeros(b, t, h)}
    for i, n in enumerate(lengths):
        ids = vmap.target_ids[torch.randint(0, len(vmap.target_ids), (n,), generator=g)]
        out["input_ids"][i, :n], out["attention_mask"][i, :n] = ids, 1
        out["loss_mask"][i, n // 3: n] = 1
        out["aux_hidden"][i, :n] = torch.randn(n, 3 * h, generator=g)
        out["last_hidden"][i, :n] = head[ids.roll(-1)] * 20 + torch.randn(n, h, generator=g)
    return out


def saved_in_forward(model, teacher, vmap, head, lengths: list[int], *, ttt: int, loss: str, dtype: torch.dtype):
    """(bytes autograd saves in one forward of the trainer's step, rows each TTT step counts)."""
    trainer = Trainer(TrainSettings(max_steps=1, ttt_steps=ttt, loss=loss), model, _Batches([]), teacher, "unused",
                      compute_dtype=dtype)
    batch = trainer.prepare(random_batch(lengths, model.config.hidden_size, head, vmap))
    staged = trainer.stage(batch)
    _, got = saved_tensor_bytes(lambda: trainer.step_sums(batch, staged), exclude=[*model.parameters(), *model.buffers()])
    return got, [int(r.numel()) for r in staged[0].logit_rows]


def cpu_rows(name: str, text: dict, *, attention: str, lengths: list[int], dtype: torch.dtype, ttt: int = 3,
             vocab: int = 32000, draft_vocab: int = 8192) -> list[dict]:
    """One drafter, one batch, every objective: what autograd saves in a forward against the estimate."""
    cfg, model, vmap, head = drafter(text, vocab=vocab, draft_vocab=draft_vocab, attention=attention)
    teacher = Teacher(head, vmap, dtype=dtype)
    c = torch.finfo(dtype).bits // 8
    out = []
    for loss in LOSSES:
        got, rows = saved_in_forward(model, teacher, vmap, head, lengths, ttt=ttt, loss=loss, dtype=dtype)
        shape = BatchShape.of(lengths, sum(rows) / len(rows) / sum(lengths))
        est = activation_bytes(cfg, shape, ttt, c, StepMemory(), attention_kernel(cfg, "cpu"), e=4, loss=loss)["saved"]
        if c == 2:
            est += autocast_weight_bytes(cfg)
        out.append({"shape": name, "attention": attention, "dtype": str(dtype).removeprefix("torch."), "loss": loss,
                    "lengths": ", ".join(map(str, lengths)), "ttt_steps": ttt, "saved_mib": round(got / 2**20, 1),
                    "estimated_mib": round(est / 2**20, 1), "error": round(est / got - 1, 4)})
    return out


def gpu_row(name: str, text: dict, *, attention: str, sequences: int, length: int, vocab: int = 163840,
            draft_vocab: int = 32000, ttt: int = 3, memory: StepMemory | None = None) -> dict:
    """One real step on the GPU at the plan's layout (or ``memory``): peak allocated vs estimated."""
    from eagle3_assets.drafter.training.memory_plan import split_batch

    device = torch.device("cuda")
    cfg, model, vmap, head = drafter(text, vocab=vocab, draft_vocab=draft_vocab, attention=attention, device="cuda")
    model.embed_tokens.to(torch.bfloat16)
    plan = (estimate_step(cfg, ttt_steps=ttt, rank_sequences=sequences, max_length=length, memory=memory,
                          compute_bytes=2, capacity=torch.cuda.get_device_properties(0).total_memory)
            if memory else plan_step(cfg, capacity=int(torch.cuda.get_device_properties(0).total_memory * 0.9),
                                     ttt_steps=ttt, rank_sequences=sequences, max_length=length, compute_bytes=2))
    teacher = Teacher(head, vmap, device=device, dtype=torch.bfloat16)
    trainer = Trainer(TrainSettings(max_steps=2, ttt_steps=ttt, batch_size=sequences, max_length=length), model,
                      _Batches([]), teacher, "unused", compute_dtype=torch.bfloat16, memory=plan.memory)
    batch = random_batch([length] * sequences, cfg.hidden_size, head, vmap)
    batch = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in batch.items()}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):  # the second step holds the optimizer's state too
        parts = [trainer.prepare(p) for p in split_batch(batch, plan.memory.micro_batch_tokens)]
        trainer.train_step(parts if len(parts) > 1 else parts[0])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return {"shape": name, "attention": attention, "tokens": f"{sequences} x {length}", "layout": plan.describe(),
            "peak_allocated_gib": round(peak / GiB, 2), "reserved_gib": round(torch.cuda.max_memory_reserved() / GiB, 2),
            "estimated_gib": round(plan.peak / GiB, 2), "error": round(plan.peak / peak - 1, 4)}


def kimi_plans() -> dict:
    cfg = DrafterConfig.from_target({**KIMI, "vocab_size": 163840}, draft_vocab_size=32000, attention="mla")
    rows = {"plain step, 8 x 8192": estimate_step(cfg, ttt_steps=3, rank_sequences=8, max_length=8192,
                                                  memory=StepMemory(), compute_bytes=2, world_size=8)}
    for gpu, cap in (("H100", H100), ("H200", H200)):
        rows[gpu] = plan_step(cfg, capacity=int(cap * 0.9), ttt_steps=3, rank_sequences=8, max_length=8192, compute_bytes=2,
                              world_size=8)  # 64 sequences over 8 GPUs: DDP buckets included
    return {k: {"layout": v.describe(), "estimated_gib": round(v.peak / GiB, 1)} for k, v in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", action="store_true", help="measure peak allocated memory on the CUDA device")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    figures = {}
    if a.gpu:
        for att in ("mla", "llama"):
            for seqs, length in ((8, 2048), (2, 8192), (8, 8192)):
                row = gpu_row("kimi-k2.5", KIMI, attention=att, sequences=seqs, length=length)
                figures[f"gpu {att} {seqs}x{length}"] = row
                print(row, flush=True)
                torch.cuda.empty_cache()
    else:
        both = (torch.float32, torch.bfloat16)
        # each batch holds a run of equal lengths: one attention call, one mask for the run
        cases = [("smollm2", SMOLLM2, "llama", [256, 192, 192, 64], both), ("llama-8b", LLAMA8B, "llama", [128, 96, 96], both),
                 ("kimi-k2.5", KIMI, "mla", [128, 64, 64], both),
                 # a 1.2B Llama-style drafter under CPU autocast does not fit beside the rest in 24 GiB
                 ("kimi-k2.5", KIMI, "llama", [128, 64, 64], (torch.float32,))]
        # one fresh process per drafter: what one case leaves in the allocator must not push the next out of memory
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=1, mp_context=spawn, max_tasks_per_child=1) as pool:
            for name, text, att, lengths, dtypes in cases:
                for dtype in dtypes:
                    rows = pool.submit(cpu_rows, name, text, attention=att, lengths=lengths, dtype=dtype).result()
                    for row in rows:
                        figures[f"{name} {att} {row['dtype']} {row['loss']}"] = row
                        print(row, flush=True)
    for k, v in kimi_plans().items():
        figures[f"plan {k}"] = v
        print(k, v)
    if not a.no_record:
        from results import record

        record("training_memory_gpu" if a.gpu else "training_memory", figures,
               note=torch.cuda.get_device_name() if a.gpu else f"cpu, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
