"""Train an EAGLE-3 drafter on stored target features, single-process or under ``torchrun``.

A batch is a dict of tensors (right padding; ``attention_mask`` marks real tokens):

    input_ids      [B, T] long
    loss_mask      [B, T]        1 on assistant tokens (the end-of-turn token included)
    attention_mask [B, T]        1 on real tokens, 0 on padding
    aux_hidden     [B, T, 3H]    concat of the three aux layer outputs
    last_hidden    [B, T, H]     final post-norm state: target logits = lm_head(last_hidden)
    target_ids     [B, T] long   optional: argmax of those logits, computed when absent

The teacher is the target itself: softmax of its lm_head over the draft-vocabulary columns
(renormalised there). Unrolled step s at index t predicts token t + 2 + s (see
``Eagle3Drafter.forward``) and is scored against the target's distribution at t + 1 + s; it
counts only where token t + 2 + s is supervised (``loss_mask``) and the target's argmax there
is in the draft vocabulary. Each step's soft cross-entropy is averaged over the positions that
count *in the global batch* (so 1 process and N processes compute the same gradient), and the
steps are summed with weights ``step_loss_decay ** s``.

Batches come from ``batches(epoch)``, a deterministic function of the epoch (or any re-iterable
of batches); a checkpoint stores (epoch, batch index) and resume skips to that batch. Under
DDP each rank's ``batches`` yields its own slice of the same global batches.

Entry point (single process, or ``torchrun --nproc-per-node N``)::

    python -m eagle3_assets.drafter.train --config job.json

Under Dagster Pipes (``DAGSTER_PIPES_CONTEXT`` set) rank 0 streams logs and reports the
materialization with the training metrics.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from eagle3_assets.drafter.model import (
    DrafterConfig,
    Eagle3Drafter,
    build_drafter,
    read_target_config,
    read_target_embeddings,
    read_target_lm_head,
    shift_left,
)
from eagle3_assets.drafter.vocab_map import VocabMap, check_vocab_map, count_tokens, counts_hash, load_or_build_vocab_map

CHECKPOINT_FORMAT = "eagle3-drafter-train-v1"
FEATURE_KEYS = ("input_ids", "loss_mask", "aux_hidden", "last_hidden")


# ----------------------------------------------------------------------------- config


@dataclass
class TrainConfig:
    max_steps: int
    batch_size: int = 8  # global batch (sequences), split across ranks
    ttt_steps: int = 7
    step_loss_decay: float = 0.8
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: str = "cosine"  # or "constant" (after warmup)
    grad_clip: float = 0.5  # 0: off
    max_length: int = 2048
    seed: int = 0
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    progress: bool = True

    @classmethod
    def from_recipe(cls, recipe, steps_per_epoch: int | None = None, **overrides) -> TrainConfig:
        """Training settings of a ``Recipe``; ``epochs`` needs ``steps_per_epoch``."""
        steps = recipe.max_steps
        if steps is None:
            if not steps_per_epoch:
                raise ValueError(f"recipe {recipe.name!r} counts epochs: pass steps_per_epoch")
            steps = max(1, math.ceil(recipe.epochs * steps_per_epoch))
        own = {f.name for f in fields(cls)}
        kw = {k: v for k, v in recipe.as_dict().items() if k in own and k != "max_steps"}
        kw.update(overrides)
        return cls(max_steps=steps, **kw)

    def lr_factor(self, step: int) -> float:
        """Multiplier of ``lr`` for optimizer step ``step`` (0-based): linear warmup, then
        cosine to zero at ``max_steps`` (or constant)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        progress = (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# ----------------------------------------------------------------------------- features in memory


def truncate_sample(sample: dict, max_length: int) -> dict:
    return {k: v[:max_length] for k, v in sample.items()}


def save_features(path: Path, samples: list[dict]) -> Path:
    """Pack samples along the token axis into one safetensors file (plus ``offsets``)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)
    packed = {k: torch.cat([s[k] for s in samples]).contiguous() for k in FEATURE_KEYS}
    packed["offsets"] = offsets
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(packed, str(tmp))
    os.replace(tmp, path)
    return path


def load_shard_dir(directory: Path, split: str = "train") -> list[dict]:
    """The samples of one split of a hidden-state shard directory (``hidden_states`` asset)."""
    from eagle3_assets.hidden_states.reader import ShardReader

    reader = ShardReader(directory)
    return [{"input_ids": s.input_ids, "loss_mask": s.loss_mask, "aux_hidden": s.aux_hidden,
             "last_hidden": s.last_hidden} for s in reader.iter_samples(reader.sample_ids(split))]


def load_features(paths: Iterable[Path]) -> list[dict]:
    """Unpack the samples of packed feature files or shard directories, in order."""
    from safetensors.torch import load_file

    samples = []
    for p in paths:
        if Path(p).is_dir():
            samples.extend(load_shard_dir(Path(p)))
            continue
        t = load_file(str(p))
        missing = [k for k in (*FEATURE_KEYS, "offsets") if k not in t]
        if missing:
            raise ValueError(f"{p}: missing tensors {missing}")
        off = t["offsets"].tolist()
        for a, b in zip(off[:-1], off[1:]):
            samples.append({k: t[k][a:b] for k in FEATURE_KEYS})
    return samples


def mix_datasets(datasets: dict[str, list[dict]], weights: dict[str, float], seed: int) -> list[dict]:
    """Weighted mixture: weight w keeps floor(w) full copies of a dataset plus a seeded random
    fraction (w mod 1) of its samples."""
    out = []
    for i, name in enumerate(sorted(datasets)):
        samples, w = datasets[name], weights.get(name, 1.0)
        whole, frac = int(w), w - int(w)
        out.extend(samples * whole)
        if frac > 0 and samples:
            g = torch.Generator().manual_seed(seed * 1000 + i)
            keep = torch.randperm(len(samples), generator=g)[: round(frac * len(samples))]
            out.extend(samples[j] for j in sorted(keep.tolist()))
    return out


def collate(samples: list[dict]) -> dict:
    """Right-pad a list of samples into one batch."""
    t = max(int(s["input_ids"].shape[0]) for s in samples)
    b = len(samples)
    batch = {
        "input_ids": torch.zeros(b, t, dtype=torch.long),
        "loss_mask": torch.zeros(b, t, dtype=torch.long),
        "attention_mask": torch.zeros(b, t, dtype=torch.long),
    }
    for k in ("aux_hidden", "last_hidden"):
        batch[k] = samples[0][k].new_zeros(b, t, samples[0][k].shape[-1])
    if all("target_ids" in s for s in samples):
        batch["target_ids"] = torch.zeros(b, t, dtype=torch.long)
    for i, s in enumerate(samples):
        n = int(s["input_ids"].shape[0])
        batch["attention_mask"][i, :n] = 1
        for k in batch:
            if k != "attention_mask":
                batch[k][i, :n] = s[k]
    return batch


class FeatureBatches:
    """Seeded, epoch-shuffled global batches of in-memory samples; yields this rank's slice.

    ``len()`` is the number of batches per epoch. A trailing batch smaller than the number of
    ranks is dropped so that every rank sees the same number of batches.
    """

    def __init__(self, samples: list[dict], batch_size: int, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1, max_length: int | None = None, shuffle: bool = True):
        if batch_size < world_size:
            raise ValueError(f"global batch {batch_size} is smaller than the {world_size} ranks")
        self.samples = [truncate_sample(s, max_length) if max_length else s for s in samples]
        self.batch_size, self.seed, self.rank, self.world_size = batch_size, seed, rank, world_size
        self.shuffle = shuffle

    def __len__(self) -> int:
        full, rest = divmod(len(self.samples), self.batch_size)
        return full + (1 if rest >= self.world_size else 0)

    def __call__(self, epoch: int):
        n = len(self.samples)
        if self.shuffle:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch)).tolist()
        else:
            order = list(range(n))
        for i in range(len(self)):
            global_batch = order[i * self.batch_size: (i + 1) * self.batch_size]
            mine = global_batch[self.rank:: self.world_size]
            yield collate([self.samples[j] for j in mine])

    def count_tokens(self, target_vocab_size: int) -> torch.Tensor:
        """Supervised-token counts for the vocabulary map (all samples, not just this rank's)."""
        return count_tokens(((s["input_ids"], s["loss_mask"]) for s in self.samples), target_vocab_size)


def prepare_batch(batch: dict, device, dtype) -> dict:
    """Tensors on ``device``, states in the drafter's dtype (shards may hold bf16); extra
    entries such as ``sample_ids`` or ``position_ids`` (recomputed from the mask) are dropped."""
    if "cu_seqlens" in batch:
        raise ValueError("packed batches are not supported: use right-padded batches with attention_mask")
    out = {k: v.to(device, non_blocking=True) for k, v in batch.items()
           if k in (*FEATURE_KEYS, "attention_mask", "target_ids") and torch.is_tensor(v)}
    if "attention_mask" not in out:
        out["attention_mask"] = torch.ones_like(out["input_ids"])
    out["aux_hidden"], out["last_hidden"] = out["aux_hidden"].to(dtype), out["last_hidden"].to(dtype)
    return out


# ----------------------------------------------------------------------------- teacher and loss


class Teacher:
    """The target's next-token distribution restricted to the draft vocabulary."""

    def __init__(self, lm_head: torch.Tensor, vmap: VocabMap, chunk: int = 1024):
        self.head = lm_head  # [V, H]
        self.draft_head = lm_head[vmap.target_ids].contiguous()  # [N, H]
        self.t2d = vmap.t2d
        self.chunk = chunk

    def to(self, device) -> Teacher:
        self.head, self.draft_head, self.t2d = self.head.to(device), self.draft_head.to(device), self.t2d.to(device)
        return self

    @torch.no_grad()
    def target_ids(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary argmax of the target logits, chunked over tokens."""
        flat = last_hidden.reshape(-1, last_hidden.shape[-1]).to(self.head.dtype)
        out = torch.cat([(c @ self.head.T).argmax(-1) for c in flat.split(self.chunk)]) if flat.numel() else \
            torch.zeros(0, dtype=torch.long, device=flat.device)
        return out.view(last_hidden.shape[:-1])

    @torch.no_grad()
    def __call__(self, last_hidden: torch.Tensor, target_ids: torch.Tensor | None = None):
        """(probs [B, T, N], target argmax ids [B, T], argmax-in-draft-vocab [B, T])."""
        if target_ids is None:
            target_ids = self.target_ids(last_hidden)
        logits = last_hidden.to(self.draft_head.dtype) @ self.draft_head.T
        return logits.float().softmax(-1), target_ids, self.t2d[target_ids]


def add_target_ids(samples: list[dict], teacher: Teacher) -> list[dict]:
    """Precompute each sample's target argmax once (the one full-vocabulary matmul)."""
    return [{**s, "target_ids": teacher.target_ids(s["last_hidden"])} for s in samples]


def step_terms(logits_steps, batch, teacher_out, d2t):
    """Per TTT step: (loss sum, positions counted, top-1 agreements) over this rank's batch."""
    probs, target_ids, in_draft = teacher_out
    supervised = (batch["loss_mask"] > 0) & (batch["attention_mask"] > 0)
    terms = []
    for s, logits in enumerate(logits_steps):
        mask = shift_left(supervised, s + 2, fill=False) & shift_left(in_draft, s + 1, fill=False)
        p = shift_left(probs, s + 1, fill=0.0)
        ce = -(p * F.log_softmax(logits.float(), dim=-1)).sum(-1)  # soft cross-entropy [B, T]
        m = mask.float()
        pred = logits.argmax(-1)
        agree = ((pred + d2t[pred]) == shift_left(target_ids, s + 1, fill=-1)) & mask
        terms.append(((ce * m).sum(), m.sum(), agree.float().sum()))
    return terms


# ----------------------------------------------------------------------------- distributed helpers


def dist_info() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    if dist_info()[1] > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier() -> None:
    import torch.distributed as dist

    if dist_info()[1] > 1:
        dist.barrier()


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


# ----------------------------------------------------------------------------- checkpoints


def checkpoints_dir(out_dir: Path) -> Path:
    return Path(out_dir) / "checkpoints"


def latest_checkpoint(out_dir: Path) -> Path | None:
    pointer = checkpoints_dir(out_dir) / "latest"
    if not pointer.exists():
        return None
    path = checkpoints_dir(out_dir) / pointer.read_text().strip()
    return path if path.exists() else None


def _write_atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(out_dir: Path, state: dict, keep: int) -> Path:
    """Write ``step-XXXXXXXX.pt`` through a temporary file, then move the ``latest`` pointer;
    a crash at any point leaves the previous checkpoint intact and pointed to."""
    d = checkpoints_dir(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"step-{state['step']:08d}.pt"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)
    _write_atomic_text(d / "latest", path.name)
    for old in sorted(d.glob("step-*.pt"))[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: Path) -> dict:
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: not a drafter training checkpoint ({state.get('format')!r})")
    return state


# ----------------------------------------------------------------------------- metrics and plot


def plot_training_curve(metrics: list[dict], path: Path) -> Path:
    """Loss and top-1 accuracy per TTT position against the step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [m["step"] for m in metrics]
    n = len(metrics[0]["loss_per_step"]) if metrics else 0
    for s in range(n):
        ax1.plot(steps, [m["loss_per_step"][s] for m in metrics], label=f"step {s}")
        ax2.plot(steps, [m["acc_per_step"][s] for m in metrics], label=f"step {s}")
    ax1.set_title("soft cross-entropy per TTT step")
    ax2.set_title("top-1 agreement with the target per TTT step")
    for ax in (ax1, ax2):
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return path


@dataclass
class TrainResult:
    steps: int
    final: dict  # the last step's metrics
    metrics: list[dict]
    checkpoint: Path | None
    metrics_path: Path | None
    curve_path: Path | None
    tokens_per_s: float  # real (non-padding) tokens per second of wall time in this run
    data_share: float  # fraction of step time spent waiting for the next batch
    wall_s: float
    stopped_early: bool = False
    summary: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- the loop


def train(
    cfg: TrainConfig,
    model: Eagle3Drafter,
    batches: Callable[[int], Iterable[dict]] | Iterable[dict],
    teacher: Teacher,
    out_dir: Path,
    *,
    resume: bool = True,
    stop_after: int | None = None,
    on_metrics: Callable[[dict], None] | None = None,
    vocab_hash: str | None = None,
) -> TrainResult:
    """Train ``model`` in place for ``cfg.max_steps`` optimizer steps.

    ``stop_after`` ends the run after that many total steps *without* a final checkpoint, as a
    crash would (for tests and time-sliced jobs). With ``resume`` the run continues from the
    latest checkpoint in ``out_dir``: model, optimizer, scheduler, data position, RNG.
    """
    from tqdm import tqdm

    rank, world = dist_info()
    main = rank == 0
    out_dir = Path(out_dir)
    device = next(model.parameters()).device
    teacher.to(device)
    source = batches if callable(batches) else (lambda epoch, _b=batches: iter(_b))

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: cfg.lr_factor(i))
    step, epoch, batch_in_epoch, metrics = 0, 0, 0, []

    ckpt = latest_checkpoint(out_dir) if resume else None
    if ckpt is not None:
        state = load_checkpoint(ckpt)
        stale = vocab_hash is not None and state.get("vocab_source_hash") not in (None, vocab_hash)
        if stale or not torch.equal(state["model"]["d2t"].cpu(), model.d2t.cpu()):
            from eagle3_assets.drafter.vocab_map import StaleVocabMapError

            raise StaleVocabMapError(f"{ckpt}: trained with vocabulary map {str(state.get('vocab_source_hash'))[:16]}, "
                                     "which is not this run's; use a fresh out_dir")
        if state["drafter_config"] != model.config.to_dict():
            raise ValueError(f"{ckpt}: drafter shape differs from this run's; use a fresh out_dir")
        missing, unexpected = model.load_state_dict(state["model"], strict=False)
        if unexpected or any(not k.startswith("embed_tokens.") for k in missing):
            raise ValueError(f"{ckpt}: weights do not fit the drafter (missing {missing}, unexpected {unexpected})")
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, epoch, batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        metrics = state["metrics"]
        rngs = state["rng"]
        set_rng_state(rngs[rank] if rank < len(rngs) else rngs[0])
    else:
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)

    net = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    def checkpoint() -> Path | None:
        import torch.distributed as dist

        rngs = [rng_state()]
        if world > 1:
            rngs = [None] * world
            dist.all_gather_object(rngs, rng_state())
        path = None
        if main:
            path = save_checkpoint(out_dir, {
                "format": CHECKPOINT_FORMAT, "step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch,
                "model": model.trainable_state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "rng": rngs, "world_size": world,
                "train_config": asdict(cfg), "drafter_config": model.config.to_dict(),
                "vocab_source_hash": vocab_hash, "metrics": metrics,
            }, cfg.keep_checkpoints)
            _write_atomic_text(out_dir / "metrics.json", json.dumps(metrics))
        barrier()
        return path

    it = iter(itertools.islice(source(epoch), batch_in_epoch, None))
    bar = tqdm(total=cfg.max_steps, initial=step, desc="drafter", disable=not (main and cfg.progress),
               dynamic_ncols=True, file=sys.stderr)
    t_start, data_time, tokens_run, steps_run, stopped_early = time.perf_counter(), 0.0, 0, 0, False
    last_ckpt = ckpt
    net.train()
    while step < cfg.max_steps:
        if stop_after is not None and step >= stop_after:
            stopped_early = True
            break
        t0 = time.perf_counter()
        batch = next(it, None)
        if batch is None:  # end of epoch
            epoch, batch_in_epoch = epoch + 1, 0
            it = iter(source(epoch))
            batch = next(it, None)
            if batch is None:
                break  # a one-shot iterable is exhausted: nothing more to train on
        batch = prepare_batch(batch, device, model.fc.weight.dtype)
        t1 = time.perf_counter()

        teacher_out = teacher(batch["last_hidden"], batch.get("target_ids"))
        logits_steps = net(batch["input_ids"], batch["aux_hidden"], batch["attention_mask"], ttt_steps=cfg.ttt_steps)
        terms = step_terms(logits_steps, batch, teacher_out, model.d2t)
        # One all-reduce gives every rank the global counts (for the loss) and sums (for logs).
        stats = torch.stack([torch.stack([t[0].detach(), t[1], t[2]]) for t in terms])  # [S, 3]
        tokens = batch["attention_mask"].sum().to(stats.dtype)
        stats = all_reduce_sum(torch.cat([stats.reshape(-1), tokens.reshape(1)]))
        tokens = int(stats[-1])
        stats = stats[:-1].view(-1, 3)
        loss = sum(
            (cfg.step_loss_decay ** s) * t[0] / stats[s, 1].clamp(min=1.0) for s, t in enumerate(terms)
        ) * world  # DDP averages gradients over ranks; the global normaliser already counts them all
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip) if cfg.grad_clip > 0 else \
            torch.norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        step, batch_in_epoch = step + 1, batch_in_epoch + 1

        loss_per_step = (stats[:, 0] / stats[:, 1].clamp(min=1.0)).tolist()
        acc_per_step = (stats[:, 2] / stats[:, 1].clamp(min=1.0)).tolist()
        t2 = time.perf_counter()
        m = {
            "step": step, "epoch": epoch, "lr": lr, "grad_norm": float(grad_norm),
            "loss": sum((cfg.step_loss_decay ** s) * v for s, v in enumerate(loss_per_step)),
            "loss_per_step": loss_per_step, "acc_per_step": acc_per_step,
            "positions": stats[:, 1].tolist(), "tokens": tokens,
            "step_time": t2 - t0, "data_time": t1 - t0,
        }
        metrics.append(m)
        data_time += t1 - t0
        tokens_run += tokens
        steps_run += 1
        bar.update(1)
        bar.set_postfix(loss=f"{m['loss']:.3f}", acc0=f"{acc_per_step[0]:.2f}")
        if on_metrics is not None and main:
            on_metrics(m)
        if step % cfg.checkpoint_every == 0 or step == cfg.max_steps:
            last_ckpt = checkpoint()
    bar.close()
    wall = time.perf_counter() - t_start

    metrics_path = curve_path = None
    if main and metrics and not stopped_early:
        metrics_path = out_dir / "metrics.json"
        _write_atomic_text(metrics_path, json.dumps(metrics))
        curve_path = plot_training_curve(metrics, out_dir / "training_curve.png")
    step_time = sum(m["step_time"] for m in metrics[-steps_run:]) if steps_run else 0.0
    result = TrainResult(
        steps=step, final=metrics[-1] if metrics else {}, metrics=metrics, checkpoint=last_ckpt,
        metrics_path=metrics_path, curve_path=curve_path,
        tokens_per_s=tokens_run / wall if wall > 0 else 0.0,
        data_share=data_time / step_time if step_time > 0 else 0.0,
        wall_s=wall, stopped_early=stopped_early,
    )
    result.summary = summarize(result)
    return result


def summarize(result: TrainResult) -> dict:
    f = result.final
    return {
        "steps": result.steps,
        "final_loss": f.get("loss"),
        "final_acc_per_step": f.get("acc_per_step"),
        "final_loss_per_step": f.get("loss_per_step"),
        "first_loss": result.metrics[0]["loss"] if result.metrics else None,
        "tokens_per_s": result.tokens_per_s,
        "data_share": result.data_share,
        "wall_s": result.wall_s,
    }


# ----------------------------------------------------------------------------- the job (entry point)


@dataclass
class TrainJob:
    """What ``python -m eagle3_assets.drafter.train --config job.json`` runs."""

    target_dir: str  # the target's HF directory (config.json + safetensors)
    features: list[str]  # packed feature files (see save_features) or shard dirs (train split)
    out_dir: str
    train: dict  # TrainConfig fields
    draft_vocab_size: int
    intermediate_size: int | None = None
    aux_layer_ids: list[int] | None = None
    weights: list[float] | None = None  # per entry of ``features``: share of each epoch
    init_seed: int | None = None  # drafter init; default train.seed
    resume: bool = True
    stop_after: int | None = None
    threads: int = 0  # torch threads per process; 0 leaves torch's default
    device: str = "auto"  # auto: cuda when available
    export: dict | None = None  # {"sglang": true, "vllm": true, "dtype": "bfloat16"}
    pipes_asset_key: str | None = None

    @classmethod
    def from_json(cls, path: Path) -> TrainJob:
        raw = json.loads(Path(path).read_text())
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{path}: unknown fields {unknown}")
        return cls(**raw)


def _init_distributed() -> torch.device:
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def run_job(job: TrainJob, on_metrics=None) -> dict:
    """Load features and target files, build (or resume) the drafter, train, export on rank 0."""
    if job.threads > 0:
        torch.set_num_threads(job.threads)
    device = _init_distributed() if job.device == "auto" else torch.device(job.device)
    rank, world = dist_info()
    out_dir = Path(job.out_dir)
    target_cfg = read_target_config(job.target_dir)
    cfg = TrainConfig(**{**job.train, "betas": tuple(job.train.get("betas", (0.9, 0.95)))})
    dcfg = DrafterConfig.from_target(target_cfg, draft_vocab_size=job.draft_vocab_size,
                                     aux_layer_ids=job.aux_layer_ids, intermediate_size=job.intermediate_size)

    if job.weights:
        per = {str(p): load_features([Path(p)]) for p in job.features}
        samples = mix_datasets(per, dict(zip(per, job.weights)), seed=cfg.seed)
    else:
        samples = load_features([Path(p) for p in job.features])
    data = FeatureBatches(samples, cfg.batch_size, seed=cfg.seed, rank=rank, world_size=world, max_length=cfg.max_length)
    counts = data.count_tokens(dcfg.vocab_size)
    if rank == 0:
        vmap = load_or_build_vocab_map(out_dir, counts, dcfg.draft_vocab_size)
    barrier()
    if rank != 0:
        vmap = load_or_build_vocab_map(out_dir, counts, dcfg.draft_vocab_size)
    check_vocab_map(vmap, source_hash=counts_hash(counts))

    model = build_drafter(dcfg, read_target_embeddings(job.target_dir), vmap,
                          seed=cfg.seed if job.init_seed is None else job.init_seed).to(device)
    teacher = Teacher(read_target_lm_head(job.target_dir).float(), vmap)
    data.samples = add_target_ids(data.samples, teacher)
    result = train(cfg, model, data, teacher, out_dir, resume=job.resume, stop_after=job.stop_after,
                   on_metrics=on_metrics, vocab_hash=vmap.source_hash)

    summary = {**result.summary, "world_size": world, "vocab_map": vmap.summary(),
               "checkpoint": str(result.checkpoint) if result.checkpoint else None,
               "metrics_path": str(result.metrics_path) if result.metrics_path else None,
               "curve_path": str(result.curve_path) if result.curve_path else None,
               "stopped_early": result.stopped_early}
    if rank == 0 and job.export and not result.stopped_early:
        from eagle3_assets.drafter.export import export_sglang, export_vllm

        dtype = job.export.get("dtype", "bfloat16")
        if job.export.get("sglang", True):
            summary["sglang_dir"] = str(export_sglang(model, out_dir / "sglang", dtype=dtype))
        if job.export.get("vllm", True):
            summary["vllm_dir"] = str(export_vllm(model, out_dir / "vllm", dtype=dtype,
                                                  verifier=str(job.target_dir),
                                                  speculative_tokens=job.export.get("speculative_k", 3)))
    if rank == 0:
        _write_atomic_text(out_dir / "result.json", json.dumps(summary, indent=2))
    barrier()
    return summary


def _open_pipes():
    """The Dagster Pipes context when this process was launched by Pipes, else None."""
    if not os.environ.get("DAGSTER_PIPES_CONTEXT"):
        return None
    try:
        from dagster_pipes import open_dagster_pipes
    except ImportError:
        return None
    return open_dagster_pipes()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="a TrainJob as JSON")
    args = ap.parse_args(argv)
    job = TrainJob.from_json(Path(args.config))
    rank = int(os.environ.get("RANK", "0"))
    pipes = _open_pipes() if rank == 0 else None
    try:
        if pipes is None:
            run_job(job)
        else:
            with pipes:
                every = max(1, job.train.get("max_steps", 100) // 20)

                def report(m: dict) -> None:
                    if m["step"] % every == 0:
                        pipes.log.info(json.dumps({k: m[k] for k in ("step", "loss", "acc_per_step", "lr")}))

                summary = run_job(job, on_metrics=report)
                meta = {k: v for k, v in summary.items() if isinstance(v, (int, float, str)) and v is not None}
                meta["final_acc_per_step"] = json.dumps(summary.get("final_acc_per_step"))
                pipes.report_asset_materialization(metadata=meta, asset_key=job.pipes_asset_key)
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
