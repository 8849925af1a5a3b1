"""The training loop: unrolled training-time test against the target's own distribution.

A batch (right padding; ``attention_mask`` marks real tokens) holds ``input_ids`` [B, T],
``loss_mask`` [B, T], ``aux_hidden`` [B, T, 3H] and ``last_hidden`` [B, T, H]. Each TTT
step's objective (``loss``: forward KL, TV, -log alpha or the LK blend) is averaged over the
positions that count *in the global batch*, so one process and N processes compute the same
gradient; the steps are summed with weights ``step_loss_decay ** s``. ``feature_noise`` perturbs
the target features of each batch (keyed by seed, step and rank: a resumed run draws what the
uninterrupted one drew). On a GPU the drafter runs under bf16 autocast (fp32 master weights)
and the teacher in bf16; on CPU both run in fp32.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from eagle3_assets.drafter.model import Eagle3Drafter
from eagle3_assets.drafter.packing import PackedBatch
from eagle3_assets.drafter.training.checkpoints import latest_checkpoint, load_checkpoint, save_checkpoint, write_atomic_text
from eagle3_assets.drafter.training.config import TrainSettings
from eagle3_assets.drafter.training.distributed import all_reduce_sum, barrier, dist_info, rng_state, set_rng_state
from eagle3_assets.drafter.training.metrics import TrainResult, add_step, new_segment, plot_training_curve, segment_from_metrics
from eagle3_assets.drafter.training.optim import Optimizers
from eagle3_assets.drafter.training.teacher import TERMS, TargetIdCache, Teacher, padded_step_terms, step_terms

# Settings a resumed run may change: they decide when to stop and what to keep, not the weights so far.
RESUMABLE_CHANGES = {"max_steps", "epochs", "checkpoint_every", "keep_checkpoints"}


class Trainer:
    """Trains ``model`` in place on ``data`` (``len()`` batches per epoch, ``epoch(e, start)``)."""

    def __init__(self, settings: TrainSettings, model: Eagle3Drafter, data, teacher: Teacher, out_dir: Path, *,
                 total_steps: int | None = None, compute_dtype: torch.dtype = torch.float32,
                 vocab_hash: str | None = None, progress: bool = True, packed: bool = True):
        self.settings, self.model, self.data, self.teacher = settings, model, data, teacher
        self.out_dir = Path(out_dir)
        self.total_steps = total_steps or settings.total_steps(len(data))
        self.compute_dtype, self.vocab_hash, self.progress, self.packed = compute_dtype, vocab_hash, progress, packed
        self.target_ids = TargetIdCache(teacher)
        self.rank, self.world = dist_info()
        self.device = next(model.parameters()).device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = Optimizers(settings, model, self.total_steps)
        self.step, self.epoch, self.batch_in_epoch, self.metrics = 0, 0, 0, []
        self.segments: list[dict] = []  # the figures of each earlier run of this training, from the checkpoint
        self.segment: dict | None = None  # this run's, so far
        self.net = model

    # -- state ----------------------------------------------------------------------------

    def restore(self) -> Path | None:
        """Continue from the latest checkpoint in ``out_dir``, refusing one of another run."""
        ckpt = latest_checkpoint(self.out_dir)
        if ckpt is None:
            return None
        state = load_checkpoint(ckpt)
        stale = self.vocab_hash is not None and state.get("vocab_source_hash") not in (None, self.vocab_hash)
        if stale or not torch.equal(state["model"]["d2t"].cpu(), self.model.d2t.cpu()):
            from eagle3_assets.drafter.vocab_map import StaleVocabMapError

            raise StaleVocabMapError(f"{ckpt}: trained with vocabulary map {str(state.get('vocab_source_hash'))[:16]}, "
                                     "which is not this run's; use a fresh out_dir")
        if type(self.model.config).from_dict(state["drafter_config"]).to_dict() != self.model.config.to_dict():
            raise ValueError(f"{ckpt}: drafter shape differs from this run's; use a fresh out_dir")
        # settings added since a checkpoint was written count as their defaults
        theirs = {**TrainSettings.model_construct().model_dump(mode="json"), **state["training"]}
        ours = self.settings.model_dump(mode="json")
        changed = sorted(k for k in ours if k not in RESUMABLE_CHANGES and theirs.get(k) != ours[k])
        if changed:
            raise ValueError(f"{ckpt}: trained with other settings ({', '.join(changed)}); use a fresh out_dir")
        missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
        if unexpected or any(not k.startswith("embed_tokens.") for k in missing):
            raise ValueError(f"{ckpt}: weights do not fit the drafter (missing {missing}, unexpected {unexpected})")
        self.optimizer.load_state_dict(state["optimizer"], state["scheduler"])
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        self.metrics = state["metrics"]
        self.segments = state.get("segments") or [segment_from_metrics(self.metrics)]
        rngs = state["rng"]
        set_rng_state(rngs[self.rank] if self.rank < len(rngs) else rngs[0])
        return ckpt

    def checkpoint(self) -> Path | None:
        import torch.distributed as dist

        rngs = [rng_state()]
        if self.world > 1:
            rngs = [None] * self.world
            dist.all_gather_object(rngs, rng_state())
        path = None
        if self.rank == 0:
            optimizer, scheduler = self.optimizer.state_dict()
            path = save_checkpoint(self.out_dir, {
                "step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                "model": self.model.trainable_state_dict(), "optimizer": optimizer,
                "scheduler": scheduler, "rng": rngs, "world_size": self.world,
                "training": self.settings.model_dump(mode="json"), "drafter_config": self.model.config.to_dict(),
                "vocab_source_hash": self.vocab_hash, "metrics": self.metrics,
                "segments": self.segments + ([dict(self.segment)] if self.segment else []),
            }, self.settings.keep_checkpoints)
            write_atomic_text(self.out_dir / "metrics.json", json.dumps(self.metrics))
        barrier()
        return path

    # -- data -----------------------------------------------------------------------------

    def batches(self) -> Iterator[dict]:
        """This rank's batches from the current data position on, across epochs."""
        while True:
            produced = False
            for batch in self.data.epoch(self.epoch, self.batch_in_epoch):
                produced = True
                yield batch
            if not produced and self.batch_in_epoch == 0:
                return  # no data at all
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    def prepare(self, batch: dict) -> dict:
        """Tensors on the device; states (stored in bf16 or fp32) in the compute dtype."""
        out = {k: batch[k].to(self.device, non_blocking=True)
               for k in ("input_ids", "loss_mask", "attention_mask", "aux_hidden", "last_hidden")}
        if "keys" in batch:
            out["keys"] = batch["keys"]
        for k in ("aux_hidden", "last_hidden"):
            out[k] = out[k].to(self.compute_dtype)
        return out

    # -- one optimizer step -----------------------------------------------------------------

    def _autocast(self):
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def noisy(self, aux: torch.Tensor) -> torch.Tensor:
        """``aux`` plus uniform noise in [-a, a], a = feature_noise x each token's feature RMS.

        The draws come from a generator keyed by (seed, step, rank), not from the global stream:
        a run resumed from a checkpoint (or relaunched by a scheduler) draws exactly what the
        uninterrupted run drew, whatever else touched the global generator in between."""
        a = self.settings.feature_noise * aux.pow(2).mean(-1, keepdim=True).sqrt()
        key = (self.settings.seed * 1_000_003 + self.step) * 1_009 + self.rank
        g = torch.Generator(device=aux.device).manual_seed(key % (1 << 63))
        u = torch.rand(aux.shape, generator=g, device=aux.device, dtype=torch.float32).to(aux.dtype)
        return aux + (u * 2 - 1) * a

    def objective(self, sums: dict, n: torch.Tensor, alpha_mean: float) -> torch.Tensor:
        """The recipe's loss for one TTT step from its summed terms over ``n`` global positions."""
        kind = self.settings.loss
        if kind == "lk":  # LK: lambda from the batch's acceptance rate, never differentiated
            lam = math.exp(-self.settings.lk_eta * alpha_mean)
            return (lam * sums["kl"] + (1 - lam) * sums["tv"]) / n
        return sums[kind] / n

    def step_sums(self, batch: dict) -> list[dict]:
        """Forward pass and the summed loss terms of every TTT step on this rank's batch."""
        s = self.settings
        need = ("kl", "tv") if s.loss == "lk" else (s.loss,)
        if not self.packed:  # the padded batch as it is (the yardstick)
            teacher_out = self.teacher(batch["last_hidden"])
            aux = self.noisy(batch["aux_hidden"]) if s.feature_noise > 0 else batch["aux_hidden"]
            with self._autocast():
                logits = self.net(batch["input_ids"], aux, batch["attention_mask"], ttt_steps=s.ttt_steps)
            return padded_step_terms(logits, batch, teacher_out, self.model.d2t, need)
        packed = PackedBatch(batch, s.ttt_steps)  # no work on padding; the teacher only where it is read
        target_ids = self.target_ids(batch.get("keys"), packed)
        teacher_out = self.teacher(packed.last_hidden[packed.teacher_rows][None], target_ids[None])
        in_draft = torch.zeros(packed.n, dtype=torch.bool, device=self.device)
        in_draft[packed.teacher_rows] = teacher_out[2][0]
        packed.count(in_draft)
        aux = self.noisy(packed.aux_hidden) if s.feature_noise > 0 else packed.aux_hidden
        with self._autocast():
            logits = self.net(packed.input_ids, aux, ttt_steps=s.ttt_steps, packed=packed)
        return step_terms(logits, packed, teacher_out, self.model.d2t, need)

    def train_step(self, batch: dict) -> dict:
        s = self.settings
        terms = self.step_sums(batch)
        # One all-reduce gives every rank the global counts (for the loss) and sums (for logs).
        stats = torch.stack([torch.stack([t[k].detach() for k in TERMS]) for t in terms])  # [S, len(TERMS)]
        tokens = batch["attention_mask"].sum().to(stats.dtype)
        stats = all_reduce_sum(torch.cat([stats.reshape(-1), tokens.reshape(1)]))
        tokens = int(stats[-1])
        stats = stats[:-1].view(len(terms), len(TERMS))
        col = {k: stats[:, i] for i, k in enumerate(TERMS)}
        n = col["positions"].clamp(min=1.0)
        alpha = (1.0 - col["tv"] / n).tolist()
        loss = sum((s.step_loss_decay ** i) * self.objective(t, n[i], alpha[i]) for i, t in enumerate(terms)) \
            * self.world  # DDP averages gradients over ranks; the global normaliser already counts them all
        self.optimizer.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, s.grad_clip) if s.grad_clip > 0 else \
            torch.norm(torch.stack([p.grad.norm() for p in self.params if p.grad is not None]))
        lr = self.optimizer.lr
        self.optimizer.step()
        loss_per_step = [float(self.objective({k: col[k][i] for k in TERMS}, n[i], alpha[i])) for i in range(len(terms))]
        return {
            "step": self.step + 1, "epoch": self.epoch, "lr": lr, "grad_norm": float(grad_norm),
            "loss": sum((s.step_loss_decay ** i) * v for i, v in enumerate(loss_per_step)),
            "loss_per_step": loss_per_step, "acc_per_step": (col["agree"] / n).tolist(),
            "alpha_per_step": alpha, "positions": col["positions"].tolist(), "tokens": tokens,
        }

    # -- the run --------------------------------------------------------------------------

    def run(self, *, resume: bool = True, stop_after: int | None = None,
            on_metrics: Callable[[dict], None] | None = None) -> TrainResult:
        """Train to ``total_steps``. ``stop_after`` ends the run after that many total steps
        *without* a final checkpoint, as a crash would (for tests and time-sliced jobs)."""
        from tqdm import tqdm

        last_ckpt = self.restore() if resume else None
        if last_ckpt is None:
            torch.manual_seed(self.settings.seed)
            random.seed(self.settings.seed)
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.net = DDP(self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        main = self.rank == 0
        bar = tqdm(total=self.total_steps, initial=self.step, desc="drafter", dynamic_ncols=True, file=sys.stderr,
                   disable=not (main and self.progress))
        t_start, stopped = time.perf_counter(), False
        seg = self.segment = new_segment(self.step, resumed=last_ckpt is not None)
        stream = self.batches()
        self.net.train()
        while self.step < self.total_steps:
            if stop_after is not None and self.step >= stop_after:
                stopped = True
                break
            t0 = time.perf_counter()
            batch = next(stream, None)
            if batch is None:
                break  # no data to train on
            batch = self.prepare(batch)
            t1 = time.perf_counter()
            m = self.train_step(batch)
            self.step, self.batch_in_epoch = self.step + 1, self.batch_in_epoch + 1
            t2 = time.perf_counter()
            m.update(step_time=t2 - t0, data_time=t1 - t0)
            self.metrics.append(m)
            add_step(seg, self.step, m["tokens"], t1 - t0, t2 - t0, t2 - t_start)
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.3f}", acc0=f"{m['acc_per_step'][0]:.2f}")
            if on_metrics is not None and main:
                on_metrics(m)
            if self.step % self.settings.checkpoint_every == 0 or self.step == self.total_steps:
                last_ckpt = self.checkpoint()
        bar.close()
        self.segments.append(seg)
        self.segment = None
        metrics_path = curve_path = None
        if main and self.metrics and not stopped:
            metrics_path = self.out_dir / "metrics.json"
            write_atomic_text(metrics_path, json.dumps(self.metrics))
            curve_path = plot_training_curve(self.metrics, self.out_dir / "training_curve.png")
        result = TrainResult(
            steps=self.step, final=self.metrics[-1] if self.metrics else {}, metrics=self.metrics, checkpoint=last_ckpt,
            metrics_path=metrics_path, curve_path=curve_path, stopped_early=stopped, segments=list(self.segments),
        )
        result.summary = result.summarize()
        return result


def train(settings: TrainSettings, model: Eagle3Drafter, data, teacher: Teacher, out_dir: Path, *,
          resume: bool = True, stop_after: int | None = None, on_metrics=None, **trainer_kw) -> TrainResult:
    """Build a :class:`Trainer` and run it (see there)."""
    trainer = Trainer(settings, model, data, teacher, out_dir, **trainer_kw)
    return trainer.run(resume=resume, stop_after=stop_after, on_metrics=on_metrics)
