"""The training loop: unrolled training-time test against the target's own distribution.

A batch (right padding; ``attention_mask`` marks real tokens) holds ``input_ids`` [B, T],
``loss_mask`` [B, T], ``aux_hidden`` [B, T, 3H] and ``last_hidden`` [B, T, H]. Each TTT
step's objective (``loss``: forward KL, TV, -log alpha or the LK blend) is averaged over the
positions that count *in the global batch*, so one process and N processes compute the same
gradient; the steps are summed with weights ``step_loss_decay ** s``. ``feature_noise`` perturbs
the target features of each batch (keyed by seed, step and rank: a resumed run draws what the
uninterrupted one drew). On a GPU the drafter runs under bf16 autocast (fp32 master weights)
and the teacher in bf16; on CPU both run in fp32.

Memory (``StepMemory``, chosen by ``drafter/training/memory_plan.py`` from the recipe, the
target and the device): a rank's batch may run as several micro-batches of at most
``micro_batch_tokens`` real tokens, each forward and backward in turn, their gradients summed
(the loss is normalised by the global batch's counts, known before the first forward, so the
step's gradient is the whole batch's); each TTT step's layer may be recomputed in backward
(``checkpoint``); and the head and softmaxes may run in chunks of rows (``loss_chunk_rows``).
None of it changes the step beyond float rounding (tests/unit/drafter/test_training_memory.py).
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
from eagle3_assets.drafter.training.acceptance import best_estimate, estimate_acceptance, estimates_in
from eagle3_assets.drafter.training.checkpoints import checkpoint_path, latest_checkpoint, load_checkpoint, save_checkpoint
from eagle3_assets.drafter.training.config import TrainSettings
from eagle3_assets.drafter.training.distributed import all_reduce_sum, barrier, dist_info, rng_state, set_rng_state
from eagle3_assets.drafter.training.loss import chunked_step_terms
from eagle3_assets.drafter.training.memory_plan import StepMemory, split_batch
from eagle3_assets.drafter.training.metrics import TrainResult, add_step, new_segment, plot_training_curve, segment_from_metrics
from eagle3_assets.drafter.training.optim import Optimizers
from eagle3_assets.drafter.training.teacher import TERMS, TargetIdCache, Teacher, padded_step_terms
from eagle3_assets.files import write_text_atomic

# Settings a resumed run may change: they decide when to stop and what to keep, not the weights so far.
RESUMABLE_CHANGES = {"max_steps", "epochs", "checkpoint_every", "keep_checkpoints", "export_best"}


class Trainer:
    """Trains ``model`` in place on ``data`` (``len()`` batches per epoch, ``epoch(e, start)``); at each
    checkpoint scores the acceptance estimate at chain length ``eal_k`` on ``eval_data`` (same interface,
    one epoch) when given (``drafter/training/acceptance.py``)."""

    def __init__(self, settings: TrainSettings, model: Eagle3Drafter, data, teacher: Teacher, out_dir: Path, *,
                 total_steps: int | None = None, compute_dtype: torch.dtype = torch.float32,
                 vocab_hash: str | None = None, progress: bool = True, packed: bool = True,
                 memory: StepMemory | None = None, eval_data=None, eal_k: int | None = None):
        self.settings, self.model, self.data, self.teacher = settings, model, data, teacher
        self.memory = memory or StepMemory()
        if not packed and (self.memory.micro_batch_tokens or self.memory.checkpoint or self.memory.loss_chunk_rows):
            raise ValueError("micro-batches, activation checkpointing and loss chunks need the packed batch (packed: true)")
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
        self.eval_data = eval_data
        self.eal_k = min(eal_k or settings.ttt_steps, settings.ttt_steps)  # the chain never runs past what was trained
        self._noise: torch.Generator | None = None  # this step's feature-noise stream (``noisy``)

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
        path, best = None, self.best()
        if self.rank == 0:
            optimizer, scheduler = self.optimizer.state_dict()
            path = save_checkpoint(self.out_dir, {
                "step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                "model": self.model.trainable_state_dict(), "optimizer": optimizer,
                "scheduler": scheduler, "rng": rngs, "world_size": self.world,
                "training": self.settings.model_dump(mode="json"), "drafter_config": self.model.config.to_dict(),
                "vocab_source_hash": self.vocab_hash, "metrics": self.metrics,
                "segments": self.segments + ([dict(self.segment)] if self.segment else []),
            }, self.settings.keep_checkpoints, best_step=best["step"] if best else None)
            write_text_atomic(self.out_dir / "metrics.json", json.dumps(self.metrics))
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
        if self.device.type != "cpu":  # the layout of the batch, read without waiting on the device
            out["host_attention_mask"], out["host_loss_mask"] = batch["attention_mask"], batch["loss_mask"]
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
        uninterrupted one drew, whatever else touched the global generator in between. The
        micro-batches of a step draw one after the other from the step's one generator, which
        on a CPU gives each token the noise of the unsplit batch (its generator is serial)."""
        a = self.settings.feature_noise * aux.pow(2).mean(-1, keepdim=True).sqrt()
        if self._noise is None:
            key = (self.settings.seed * 1_000_003 + self.step) * 1_009 + self.rank
            self._noise = torch.Generator(device=aux.device).manual_seed(key % (1 << 63))
        u = torch.rand(aux.shape, generator=self._noise, device=aux.device, dtype=torch.float32).to(aux.dtype)
        return aux + (u * 2 - 1) * a

    def objective(self, sums: dict, n, alpha_mean) -> torch.Tensor:
        """The recipe's loss for one TTT step from its summed terms over ``n`` global positions
        (``alpha_mean`` a float or a 0-d tensor: the lk weight is read on the device, no sync)."""
        kind = self.settings.loss
        if kind == "lk":  # LK: lambda from the batch's acceptance rate, never differentiated
            lam = (torch.exp(-self.settings.lk_eta * alpha_mean) if torch.is_tensor(alpha_mean)
                   else math.exp(-self.settings.lk_eta * alpha_mean))
            if torch.is_tensor(lam):
                lam = lam.to(sums["kl"].dtype) if torch.is_tensor(sums["kl"]) else float(lam)
            return (lam * sums["kl"] + (1 - lam) * sums["tv"]) / n
        return sums[kind] / n

    def stage(self, batch: dict) -> tuple[PackedBatch, torch.Tensor]:
        """A packed batch whose counted rows are known (they need the target's argmax), and its
        target ids on the teacher rows: everything before the forward, without gradients. From
        cached ids (every epoch after the first) nothing here waits on the device."""
        packed = PackedBatch(batch, self.settings.ttt_steps)  # no work on padding; the teacher only where it is read
        target_ids = self.target_ids(batch.get("keys"), packed)
        t2d = self.teacher.t2d if target_ids.device == self.teacher.t2d.device else self.teacher.t2d_host
        in_draft = torch.zeros(packed.n, dtype=torch.bool, device=target_ids.device)
        in_draft[packed.teacher_rows if target_ids.device == packed.teacher_rows.device else packed.teacher_rows_host] = \
            t2d[target_ids]
        packed.count(in_draft)
        return packed, target_ids.to(self.device, non_blocking=True)

    def step_sums(self, batch: dict, staged: tuple | None = None) -> list[dict]:
        """Forward pass and the summed loss terms of every TTT step on ``batch``, drawing this
        step's feature noise afresh (``train_step`` uses ``_sums``, whose micro-batches share it)."""
        self._noise = None
        return self._sums(batch, staged)

    def _sums(self, batch: dict, staged: tuple | None = None) -> list[dict]:
        s = self.settings
        need = ("kl", "tv") if s.loss == "lk" else (s.loss,)
        if not self.packed:  # the padded batch as it is (the yardstick)
            teacher_out = self.teacher(batch["last_hidden"])
            aux = self.noisy(batch["aux_hidden"]) if s.feature_noise > 0 else batch["aux_hidden"]
            with self._autocast():
                logits = self.net(batch["input_ids"], aux, batch["attention_mask"], ttt_steps=s.ttt_steps)
            return padded_step_terms(logits, batch, teacher_out, self.model.d2t, need)
        packed, target_ids = staged or self.stage(batch)
        teacher_logits = self.teacher.draft_logits(packed.last_hidden[packed.teacher_rows])
        aux = self.noisy(packed.aux_hidden) if s.feature_noise > 0 else packed.aux_hidden
        with self._autocast():
            hiddens = self.net(packed.input_ids, aux, ttt_steps=s.ttt_steps, packed=packed,
                               checkpoint=self.memory.checkpoint, hidden_only=True)
            return chunked_step_terms(self.model.logits, hiddens, packed, teacher_logits, target_ids, self.model.d2t,
                                      need, chunk_rows=self.memory.loss_chunk_rows)

    def weighted_loss(self, terms: list[dict], n: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        decay = self.settings.step_loss_decay
        # DDP averages gradients over ranks; the global normaliser already counts them all
        return sum((decay ** i) * self.objective(t, n[i], alpha[i]) for i, t in enumerate(terms)) * self.world

    def _sync_context(self, last: bool):
        return self.net.no_sync() if self.net is not self.model and not last else contextlib.nullcontext()

    def train_step(self, batch: dict | list[dict]) -> dict:
        """One optimizer step on this rank's batch, or on its micro-batches (a list) in turn."""
        s = self.settings
        parts = batch if isinstance(batch, list) else [batch]
        tokens = sum(p["attention_mask"].sum() for p in parts).to(torch.float32)
        self.optimizer.zero_grad()
        self._noise = None
        if len(parts) == 1:  # forward, then the global counts (and the batch's alpha for lk), then backward
            terms = self._sums(parts[0])
            stats = torch.stack([torch.stack([t[k].detach() for k in TERMS]) for t in terms])  # [S, len(TERMS)]
            stats = all_reduce_sum(torch.cat([stats.reshape(-1), tokens.reshape(1)]))
            tokens, stats = stats[-1], stats[:-1].view(len(terms), len(TERMS))
            n, alpha = self._normaliser(stats)
            self.weighted_loss(terms, n, alpha).backward()
        else:  # the counts are known before any forward: each micro-batch's backward frees its activations
            staged = [self.stage(p) for p in parts]
            parts[:] = [None] * len(parts)  # the packed copies are all the step reads now: free the padded batches
            counts = torch.tensor([[float(st[0].logit_rows[i].numel()) for i in range(s.ttt_steps)] for st in staged],
                                  device=self.device).sum(0)
            counts = all_reduce_sum(torch.cat([counts, tokens.to(self.device).reshape(1)]))
            tokens, n = counts[-1], counts[:-1].clamp(min=1.0)
            alpha = self._prepass_alpha(parts, staged, n) if s.loss == "lk" else torch.ones_like(n)
            self._noise = None  # the pass with gradients draws the prepass's noise again
            stats = torch.zeros(s.ttt_steps, len(TERMS), device=self.device)
            for i, (part, st) in enumerate(zip(parts, staged)):
                with self._sync_context(i == len(parts) - 1):
                    terms = self._sums(part, st)
                    self.weighted_loss(terms, n, alpha).backward()
                stats += torch.stack([torch.stack([t[k].detach() for k in TERMS]) for t in terms])
                del terms
            stats = all_reduce_sum(stats)
            n, alpha = self._normaliser(stats)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, s.grad_clip) if s.grad_clip > 0 else \
            torch.norm(torch.stack([p.grad.norm() for p in self.params if p.grad is not None]))
        lr = self.optimizer.lr
        self.optimizer.step()
        # one device-to-host copy for every figure of the step (each float() would wait for the device)
        figures = torch.cat([stats.reshape(-1).double(), n.double(), alpha.double(),
                             grad_norm.detach().double().reshape(1), tokens.double().reshape(1).to(stats.device)]).tolist()
        k = len(TERMS) * len(n)
        rows = [figures[i * len(TERMS):(i + 1) * len(TERMS)] for i in range(len(n))]
        n_l, alpha_l = figures[k:k + len(n)], figures[k + len(n):k + 2 * len(n)]
        col = {key: torch.tensor([r[j] for r in rows], dtype=torch.float32) for j, key in enumerate(TERMS)}
        loss_per_step = [float(self.objective({key: col[key][i] for key in TERMS}, n_l[i], alpha_l[i]))
                         for i in range(len(n_l))]
        return {
            "step": self.step + 1, "epoch": self.epoch, "lr": lr, "grad_norm": figures[-2],
            "loss": sum((s.step_loss_decay ** i) * v for i, v in enumerate(loss_per_step)),
            "loss_per_step": loss_per_step, "acc_per_step": [float(col["agree"][i] / n_l[i]) for i in range(len(n_l))],
            "alpha_per_step": alpha_l, "positions": [float(x) for x in col["positions"]], "tokens": int(figures[-1]),
        }

    def _normaliser(self, stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global positions per TTT step (at least 1) and the acceptance rate alpha = 1 - TV / n."""
        n = stats[:, TERMS.index("positions")].clamp(min=1.0)
        return n, (1.0 - stats[:, TERMS.index("tv")] / n).double()  # float32 as before; double for exp

    @torch.no_grad()
    def _prepass_alpha(self, parts: list[dict], staged: list, n: torch.Tensor) -> torch.Tensor:
        """lk over micro-batches: the global batch's alpha, which weighs its loss, from a forward
        without gradients (one extra forward per step; one micro-batch needs none)."""
        tv = sum(torch.stack([t["tv"] for t in self._sums(p, st)]) for p, st in zip(parts, staged))
        return (1.0 - all_reduce_sum(tv.reshape(-1)) / n).double()

    # -- the acceptance estimate ------------------------------------------------------------

    def estimate_acceptance(self) -> dict:
        """The expected accepted length of the weights now, from their drafts on ``eval_data``."""
        self.model.eval()
        figures = estimate_acceptance(self.model, self.eval_data.epoch(0), self.prepare, self.target_ids,
                                      steps=self.settings.ttt_steps, k=self.eal_k, autocast=self._autocast)
        self.net.train()
        return {"step": self.step, **figures}

    def best(self) -> dict | None:
        return best_estimate(estimates_in(self.metrics), self.eal_k)

    def use_best(self) -> dict | None:
        """Load the weights of the checkpoint with the best estimate (kept on disk by the rotation)
        into the model, unless they are the last step's; returns that estimate."""
        best = self.best()
        if best is not None and best["step"] != self.step:
            self.model.load_state_dict(load_checkpoint(checkpoint_path(self.out_dir, best["step"]))["model"], strict=False)
        return best

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
            record = batch.pop("record", None)  # what the step consumes (a stream's positions and ids)
            parts = split_batch(batch, self.memory.micro_batch_tokens)
            batch = [self.prepare(p) for p in parts] if len(parts) > 1 else self.prepare(parts[0])
            t1 = time.perf_counter()
            m = self.train_step(batch)
            self.step, self.batch_in_epoch = self.step + 1, self.batch_in_epoch + 1
            t2 = time.perf_counter()
            m.update(step_time=t2 - t0, data_time=t1 - t0)
            checkpointing = self.step % self.settings.checkpoint_every == 0 or self.step == self.total_steps
            if checkpointing and self.eval_data is not None:
                m["acceptance_estimate"] = self.estimate_acceptance()
            if record is not None:
                m["consumed"] = record  # in the metrics, so in the checkpoint: durable and atomic with the weights
            self.metrics.append(m)
            if hasattr(self.data, "after_step"):
                self.data.after_step(m)  # a stream frees what the step consumed
            add_step(seg, self.step, m["tokens"], t1 - t0, t2 - t0, t2 - t_start)
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.3f}", acc0=f"{m['acc_per_step'][0]:.2f}")
            if on_metrics is not None and main:
                on_metrics(m)
            if checkpointing:
                last_ckpt = self.checkpoint()
        bar.close()
        self.segments.append(seg)
        self.segment = None
        metrics_path = curve_path = None
        if main and self.metrics and not stopped:
            metrics_path = self.out_dir / "metrics.json"
            write_text_atomic(metrics_path, json.dumps(self.metrics))
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
