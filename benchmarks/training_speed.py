"""Training speed: the trainer as the asset runs it (``run_job``) against a bare PyTorch loop over
the same module and the same batches, side by side in one process.

The yardstick is the loop anyone would write first: the drafter ``build_drafter`` builds, the
batches ``ShardBatches`` yields (read into memory before the clock starts, so the yardstick
never waits for data), the same TTT steps, the teacher's full-vocabulary argmax and draft-
vocabulary softmax every step, forward KL over the counted positions, feature noise, gradient
clipping and AdamW; the right-padded batch, one ``scaled_dot_product_attention`` per step.
``run_job`` adds what the asset needs: the shard reader, packing, the id cache, the metrics,
checkpoints. Both report steady tokens/s (real tokens, after ``--warmup`` steps); the ratio is
the trainer's over the bare loop's. Rounds alternate (bare, trainer, bare, trainer) and the
best of each is kept, so load from elsewhere hits both alike.

The data is random: a target directory holding only what training reads (embeddings, head,
final norm) and shards written by the project's own writer. ``--shape`` picks the sizes:
``smollm2`` (the embedded target, CPU) or ``kimi-k2.5`` (hidden 7168, vocabulary 163,840: a GPU).

    .venv/bin/python benchmarks/training_speed.py [--shape smollm2] [--steps 12] [--warmup 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

SHAPES = {
    # SmolLM2-135M-Instruct, the embedded target
    "smollm2": {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
                "head_dim": 64, "vocab_size": 49152, "num_hidden_layers": 30, "max_position_embeddings": 8192,
                "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True},
    # Kimi-K2.5's text model (DeepSeek-V3 layout: MLA, yarn rope)
    "kimi-k2.5": {"hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64, "num_key_value_heads": 64,
                  "vocab_size": 163840, "num_hidden_layers": 61, "max_position_embeddings": 262144, "rms_norm_eps": 1e-5,
                  "rope_theta": 50000.0, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                  "qk_rope_head_dim": 64, "v_head_dim": 128, "head_dim": 64, "tie_word_embeddings": False,
                  "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                                   "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}},
}


def make_target(path: Path, text: dict, seed: int = 0) -> Path:
    """A target directory with the tensors training reads, random, in bf16 (as checkpoints ship)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**text, "architectures": ["LlamaForCausalLM"]}))
    g = torch.Generator().manual_seed(seed)
    v, h = text["vocab_size"], text["hidden_size"]
    tensors = {"model.embed_tokens.weight": (torch.randn(v, h, generator=g) * 0.02).to(torch.bfloat16),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    if not text.get("tie_word_embeddings"):
        tensors["lm_head.weight"] = (torch.randn(v, h, generator=g) * 0.02).to(torch.bfloat16)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def make_shards(path: Path, text: dict, samples: int, length: int, seed: int = 0) -> Path:
    """``samples`` random sequences of ``length`` tokens (loss on the last two thirds), written by
    the project's shard writer in bf16."""
    from eagle3_assets.hidden_states.write import write_samples
    from eagle3_assets.target.layers import resolve_layer_ids

    g = torch.Generator().manual_seed(seed)
    h, layers = text["hidden_size"], text["num_hidden_layers"]
    # one random block of features shifted per sample: drawing 57 KB a token afresh for every sample
    # of Kimi-K2.5's size would take longer than the training it feeds, and speed does not depend on it
    aux_block = torch.randn(length + samples, 3 * h, generator=g).to(torch.bfloat16)
    last_block = torch.randn(length + samples, h, generator=g).to(torch.bfloat16)

    def rows():
        for i in range(samples):
            mask = torch.zeros(length, dtype=torch.long)
            mask[length // 3:] = 1
            yield {"input_ids": torch.randint(0, text["vocab_size"], (length,), generator=g), "loss_mask": mask,
                   "aux_hidden": aux_block[i:i + length], "last_hidden": last_block[i:i + length]}

    write_samples(path, rows(), layer_ids=resolve_layer_ids(layers, None), num_layers=layers,
                  target={"name": "random", "hidden_size": h})
    return path


def make_job(tmp: Path, shape: str, *, samples: int, length: int, batch: int, ttt: int, draft_vocab: int,
             attention: str, steps: int, threads: int):
    from eagle3_assets.drafter.training.config import DraftShape, RuntimeSettings, TrainJob, TrainSettings
    from eagle3_assets.target.ref import TargetRef

    text = SHAPES[shape]
    target = make_target(tmp / "target", text)
    shards = make_shards(tmp / "shards", text, samples, length)
    return TrainJob(target=TargetRef(model_dir=str(target)), out_dir=str(tmp / "run"), datasets={str(shards): 1.0},
                    training=TrainSettings(max_steps=steps, ttt_steps=ttt, step_loss_decay=1.0, batch_size=batch,
                                           max_length=length, checkpoint_every=10**6, lr=1e-4),
                    shape=DraftShape(draft_vocab_size=draft_vocab, attention=attention, engines=("vllm",)),
                    runtime=RuntimeSettings(threads=threads, progress=False, resume=False))


def bare_loop(job, steps: int, warmup: int) -> dict:
    """The yardstick (see the module docstring); tokens/s after ``warmup`` steps."""
    from eagle3_assets.drafter.model import Eagle3Drafter
    from eagle3_assets.drafter.target_weights import read_target_embeddings, read_target_lm_head
    from eagle3_assets.drafter.training.data import ShardBatches, ShardDataset
    from eagle3_assets.drafter.training.job import compute_dtype, drafter_config
    from eagle3_assets.drafter.vocab_map import load_or_build_vocab_map

    s = job.training
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = compute_dtype(job, device)
    dataset = ShardDataset(job.datasets, max_length=s.max_length, seed=s.seed)
    cfg = drafter_config(job, dataset)
    vmap = load_or_build_vocab_map(Path(job.out_dir) / "bare", dataset.token_counts(cfg.vocab_size), cfg.draft_vocab_size)
    batches = list(ShardBatches(dataset, s.batch_size, seed=s.seed).epoch(0))
    with torch.device(device):
        model = Eagle3Drafter(cfg)
    model.init_weights(s.seed).set_embeddings(read_target_embeddings(job.target.model_dir)).set_vocab_map(vmap)
    head = read_target_lm_head(job.target.model_dir).to(device, dtype)
    draft_head = head[vmap.target_ids.to(device)]
    t2d = vmap.t2d.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, betas=s.betas)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    times, tokens = [], []
    for i in range(warmup + steps):
        b = {k: v.to(device, non_blocking=True) for k, v in batches[i % len(batches)].items() if torch.is_tensor(v)}
        aux, last = b["aux_hidden"].to(dtype), b["last_hidden"].to(dtype)
        with torch.no_grad():
            target_ids = (last @ head.T).argmax(-1)
            p = (last @ draft_head.T).float().softmax(-1)
        aux = aux + (torch.rand_like(aux) * 2 - 1) * s.feature_noise * aux.pow(2).mean(-1, keepdim=True).sqrt()
        with autocast:
            logits = model(b["input_ids"], aux, b["attention_mask"], ttt_steps=s.ttt_steps)
        supervised = (b["loss_mask"] > 0) & (b["attention_mask"] > 0)
        loss = 0.0
        for k, lg in enumerate(logits):
            mask = torch.zeros_like(supervised)
            mask[:, :-(k + 2)] = supervised[:, k + 2:] & t2d[target_ids[:, k + 1:-1]]
            pk = torch.zeros_like(p)
            pk[:, :-(k + 1)] = p[:, k + 1:]
            kl = -(pk * torch.log_softmax(lg.float(), -1)).sum(-1)
            loss = loss + (kl * mask).sum() / mask.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, s.grad_clip)
        opt.step()
        float(loss.detach())  # what any loop prints
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter())
        tokens.append(int(b["attention_mask"].sum()))
    return {"tokens_per_s": sum(tokens[warmup + 1:]) / (times[-1] - times[warmup])}


def trainer_run(job, steps: int, warmup: int) -> dict:
    """``run_job`` as the asset runs it; steady tokens/s from its own per-step times, the setup
    (dataset, vocabulary map, drafter, teacher) and the first step's seconds."""
    from eagle3_assets.drafter.training.job import run_job

    job = job.model_copy(update={"training": job.training.model_copy(update={"max_steps": warmup + steps})})
    t0 = time.perf_counter()
    summary = run_job(job)
    wall = time.perf_counter() - t0
    metrics = json.loads((Path(job.out_dir) / "metrics.json").read_text())
    steady = metrics[warmup + 1:]
    return {"tokens_per_s": sum(m["tokens"] for m in steady) / sum(m["step_time"] for m in steady),
            "first_step_s": metrics[0]["step_time"], "setup_s": summary.get("setup_s"), "wall_s": wall,
            "memory_layout": summary.get("memory_layout"), "peak_allocated_gib": summary.get("memory_peak_allocated_gib"),
            "estimated_gib": summary.get("memory_estimated_gib")}


def trainer_only(shape: str, *, samples: int, length: int, batch: int, ttt: int, draft_vocab: int, attention: str,
                 steps: int, warmup: int, rounds: int, threads: int) -> dict:
    """``run_job`` alone (a batch the bare loop's plain step cannot hold: the recipe's length)."""
    with tempfile.TemporaryDirectory() as tmp:
        job = make_job(Path(tmp), shape, samples=samples, length=length, batch=batch, ttt=ttt, draft_vocab=draft_vocab,
                       attention=attention, steps=warmup + steps, threads=threads)
        run = trainer_run(job, steps, warmup)
        return {"shape": shape, "attention": attention, "batch": f"{batch} x {length}", "ttt_steps": ttt,
                "trainer_tokens_per_s": round(run["tokens_per_s"], 1), "first_step_s": round(run["first_step_s"], 3),
                "setup_s": round(run["setup_s"] or math.nan, 2), "memory_layout": json.dumps(run["memory_layout"]),
                "estimated_gib": run["estimated_gib"], "peak_allocated_gib": run["peak_allocated_gib"]}


def compare(shape: str, *, samples: int, length: int, batch: int, ttt: int, draft_vocab: int, attention: str,
            steps: int, warmup: int, rounds: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        job = make_job(Path(tmp), shape, samples=samples, length=length, batch=batch, ttt=ttt, draft_vocab=draft_vocab,
                       attention=attention, steps=warmup + steps, threads=threads)
        if threads:
            torch.set_num_threads(threads)
        bare, trainer = [], []
        for r in range(rounds):
            bare.append(bare_loop(job, steps, warmup))
            trainer.append(trainer_run(job.model_copy(update={"out_dir": str(Path(tmp) / f"run{r}")}), steps, warmup))
        best_bare = max(b["tokens_per_s"] for b in bare)
        best = max(trainer, key=lambda t: t["tokens_per_s"])
        return {"shape": shape, "attention": attention, "batch": f"{batch} x {length}", "ttt_steps": ttt,
                "bare_tokens_per_s": round(best_bare, 1), "trainer_tokens_per_s": round(best["tokens_per_s"], 1),
                "ratio": round(best["tokens_per_s"] / best_bare, 3),
                "first_step_s": round(best["first_step_s"], 3), "setup_s": round(best["setup_s"] or math.nan, 2),
                "memory_layout": json.dumps(best["memory_layout"]), "estimated_gib": best["estimated_gib"],
                "peak_allocated_gib": best["peak_allocated_gib"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--attention", choices=["llama", "mla"], default=None)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    attention = a.attention or ("mla" if "q_lora_rank" in SHAPES[a.shape] else "llama")
    row = compare(a.shape, samples=a.batch * (a.steps + a.warmup), length=a.length, batch=a.batch, ttt=a.ttt,
                  draft_vocab=a.draft_vocab, attention=attention, steps=a.steps, warmup=a.warmup, rounds=a.rounds,
                  threads=a.threads)
    for k, v in row.items():
        print(f"{k:>22}: {v}")
    if not a.no_record:
        from results import record

        device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu, {torch.get_num_threads()} threads"
        record(f"training_speed_{a.shape}", {f"{row['shape']} {row['attention']}": row}, note=f"device: {device}")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
