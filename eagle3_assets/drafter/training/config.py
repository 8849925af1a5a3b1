"""The typed settings of a drafter training run, defined once.

A recipe (``recipes/<name>.toml``) is parsed into these sections, the ``drafter_checkpoint``
asset writes them unchanged into the trainer's job file, and the trainer reads them back:
the field list, defaults and limits exist here only.

- ``TrainSettings``: optimisation and data (what changes the trained weights);
- ``DraftShape``: the drafter's shape beyond what the target fixes;
- ``EvalSettings``: how the asset measures acceptance afterwards;
- ``RuntimeSettings`` and ``ExportSettings``: where and how this run executes and what it
  writes at the end (they never change the weights);
- ``TrainJob``: one run of the trainer entry point, as JSON.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from eagle3_assets.drafter.formats import serving_engines
from eagle3_assets.hidden_states.spool.settings import StreamSettings
from eagle3_assets.job_file import JobFile
from eagle3_assets.target.ref import TargetRef


class _Section(BaseModel):
    """Strict: an int field refuses bools, floats and strings; a float field takes ints."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class TrainSettings(_Section):
    """Optimisation and data settings; a checkpoint records them and resume compares them."""

    # training-time test
    ttt_steps: int = Field(7, ge=1)
    step_loss_decay: float = Field(0.8, gt=0.0, le=1.0)
    # objective: forward KL to the target (kl), total variation 1 - alpha (tv), -log alpha (nla), or
    # LK's adaptive blend lambda KL + (1 - lambda) TV with lambda = exp(-lk_eta * alpha) (lk), where
    # alpha = sum min(p, q) over the draft vocabulary is the acceptance rate of sampling
    loss: Literal["kl", "tv", "nla", "lk"] = "kl"
    lk_eta: float = Field(3.0, ge=0.0)
    # uniform noise in [-a, a] added to the target features (aux) in training, a = feature_noise
    # times each token's feature RMS (0: off); a regulariser. Alone, 0.1 moved held-out acceptance
    # +0.06 in one run of the 260-prompt ablation and +0.006 in its rerun (within the spread); it is
    # part of the best recipe both engines serve (docs/drafter-quality.md)
    feature_noise: float = Field(0.1, ge=0.0)
    # lm_head and final norm start as the target's own (its head's rows for the draft vocabulary)
    init_head_from_target: bool = False
    # ... and stays there: only fc and the decoder layer train (speculators' choice); needs the above
    freeze_head: bool = False
    # optimizer and schedule; muon: torch.optim.Muon on the 2-D weights (fc, attention, MLP, with
    # Moonshot's AdamW-matched lr scaling, so lr means the same), AdamW on the head and norms
    optimizer: Literal["adamw", "muon"] = "adamw"
    lr: float = Field(1e-4, gt=0.0)
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(0.0, ge=0.0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)  # the schedule decays to lr * min_lr_ratio
    grad_clip: float = Field(0.5, ge=0.0)  # 0 turns clipping off
    # length of training: exactly one of the two
    max_steps: int | None = Field(None, ge=1)
    epochs: float | None = Field(None, gt=0.0)
    batch_size: int = Field(8, ge=1)  # global: split across data-parallel ranks
    max_length: int = Field(2048, ge=8)  # tokens per sequence; longer samples are truncated
    seed: int = Field(0, ge=0)
    checkpoint_every: int = Field(500, ge=1)
    keep_checkpoints: int = Field(2, ge=1)  # the newest ones, and the best one by the acceptance estimate
    # the acceptance estimate (drafter/training/acceptance.py): at each checkpoint, the expected accepted
    # length on this many held-out samples of the shards (0: none); the export is the best checkpoint's
    # by it unless export_best is false (then the last step's)
    eal_samples: int = Field(256, ge=0)
    export_best: bool = True

    @field_validator("betas", mode="before")
    @classmethod
    def _betas_from_list(cls, v):
        return tuple(v) if isinstance(v, list) else v

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v):
        if not all(0.0 <= float(b) < 1.0 and math.isfinite(b) for b in v):
            raise ValueError("each beta must be in [0, 1)")
        return v

    @model_validator(mode="after")
    def _frozen_head_from_target(self):
        if self.freeze_head and not self.init_head_from_target:
            raise ValueError("'freeze_head' keeps the head as it starts: it needs init_head_from_target = true "
                             "(a frozen random head cannot learn)")
        return self

    @model_validator(mode="after")
    def _one_length(self):
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("set exactly one of 'max_steps' and 'epochs'")
        if self.max_steps is not None and self.warmup_steps and self.warmup_steps >= self.max_steps:
            raise ValueError(f"'warmup_steps' must be below max_steps ({self.max_steps})")
        return self

    def total_steps(self, batches_per_epoch: int) -> int:
        """Optimizer steps of the whole run: ``max_steps``, or ``epochs`` over the data."""
        if self.max_steps is not None:
            return self.max_steps
        return max(1, math.ceil(self.epochs * max(1, batches_per_epoch)))

    def lr_factor(self, step: int, total_steps: int) -> float:
        """Multiplier of ``lr`` at optimizer step ``step`` (0-based): linear warmup, then cosine
        or linear decay to ``min_lr_ratio`` at ``total_steps`` (or constant)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, total_steps - self.warmup_steps))
        decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.schedule == "cosine" else 1.0 - progress
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay


LAYOUT_SWITCHES = ("norm_before_fc", "fc_norm", "norm_output")  # DraftShape's switches of the drafter's network


class DraftShape(_Section):
    """What the recipe decides about the drafter's shape (hidden size and heads follow the target),
    and the engines its exports must serve on: a layout one of them would run differently from
    what was trained is refused here, before any training (the kind's and its serving formats'
    ``layout_problems``, ``drafter/formats``)."""

    draft_vocab_size: int = Field(ge=1)
    intermediate_size: int | None = Field(None, ge=1)  # None: the target's
    aux_layer_ids: list[int] | None = None  # None: [1, L//2 - 1, L - 4]
    attention: str = "llama"  # the drafter's kind, a name in drafter/kinds (KINDS); "mla": the target's own MLA shape
    norm_before_fc: bool = False  # one RMSNorm over the 3H target features before fc (vLLM only)
    fc_norm: bool = False  # EAGLE 3.1: one RMSNorm per aux layer's features before fc
    norm_output: bool = False  # EAGLE 3.1: the post-norm state is fed back to the next draft step
    engines: tuple[str, ...] = Field(default_factory=serving_engines)  # the exports written and checked

    def layout(self) -> dict[str, bool]:
        """The layout switches, as ``DrafterConfig.from_target`` takes them."""
        return {k: getattr(self, k) for k in LAYOUT_SWITCHES}

    @field_validator("engines", mode="before")
    @classmethod
    def _engines_from_list(cls, v):
        return tuple(v) if isinstance(v, list) else v

    @field_validator("engines")
    @classmethod
    def _registered_engines(cls, v):
        unknown = [e for e in v if e not in serving_engines()]
        if unknown:
            raise ValueError(f"unknown serving engine(s) {unknown}; expected some of {list(serving_engines())}")
        return v

    @field_validator("attention")
    @classmethod
    def _a_registered_kind(cls, v):
        from eagle3_assets.drafter.kinds import KINDS

        if v not in KINDS:
            raise ValueError(f"unknown drafter kind {v!r}; expected one of {sorted(KINDS)}")
        return v

    @model_validator(mode="after")
    def _servable(self):
        from eagle3_assets.drafter.formats import layout_problems

        if not self.engines or len(set(self.engines)) != len(self.engines):
            raise ValueError(f"'engines' must name each of {', '.join(serving_engines())} at most once, and at least one")
        for key, problem in layout_problems(self).items():
            raise ValueError(f"'{key}' {problem}")
        return self

    @field_validator("aux_layer_ids")
    @classmethod
    def _three_increasing(cls, v):
        if v is not None and (len(v) != 3 or min(v) < 0 or sorted(set(v)) != v):
            raise ValueError("must be three strictly increasing layer ids >= 0")
        return v


class EvalSettings(_Section):
    """Acceptance measured by real chain speculative decoding on held-out prompts."""

    # Acceptance length (accepted draft tokens + 1 per verification) the drafter must reach. An
    # untrained drafter measured 1.000 on both test graphs (nothing accepted), so the default floor
    # sits above it, and the drafter must also beat its untrained twin, measured on the same prompts,
    # by acceptance_margin: a floor of 1.0 with no margin passed an untrained drafter.
    acceptance_floor: float = Field(1.1, ge=1.0)
    acceptance_margin: float = Field(0.1, gt=0.0)
    eval_max_new_tokens: int = Field(64, ge=1)
    eval_samples: int = Field(16, ge=1)
    speculative_k: int = Field(3, ge=1)


class RuntimeSettings(_Section):
    """Where this run executes; none of it changes the trained weights."""

    device: str = "auto"  # auto: this rank's GPU when there is one, else cpu
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # compute dtype; auto: bf16 on GPU, fp32 on CPU
    threads: int = Field(0, ge=0)  # torch threads per process; 0 leaves torch's default
    loader_workers: int = Field(-1, ge=-1)  # DataLoader workers per rank; -1: 2 on GPU, 0 on CPU
    resume: bool = True
    stop_after: int | None = Field(None, ge=0)  # end after this many total steps, as a crash would
    progress: bool = True
    packed: bool = True  # train on the real tokens back to back (False: on the padded batch; same result, slower)
    # The step's memory layout (drafter/training/memory_plan.py); none of it changes the gradient beyond
    # float rounding. auto (-1 / "auto"): on a GPU the plan picks the cheapest layout that fits
    # memory_fraction of it; on a CPU the plain step. A value set here is used as it is.
    micro_batch_tokens: int = Field(-1, ge=-1)  # real tokens per forward/backward; 0: the rank's whole batch
    activation_checkpointing: Literal["auto", "on", "off"] = "auto"  # recompute each TTT step's layer in backward
    loss_chunk_rows: int = Field(-1, ge=-1)  # rows of the draft head and softmaxes at a time; 0: all at once
    memory_fraction: float = Field(0.9, gt=0.0, le=1.0)  # of the device's memory the plan may fill


class ExportSettings(_Section):
    engines: tuple[str, ...] | None = None  # the exports written, of the recipe's engines (None: all of them)
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    speculative_k: int = Field(3, ge=1)


class TrainJob(JobFile):
    """What ``python -m eagle3_assets.drafter.training --config job.json`` runs."""

    target: TargetRef  # the target's HF directory (config.json + safetensors)
    out_dir: str
    datasets: dict[str, float]  # hidden-state shard directory -> mixing weight (train split)
    stream: StreamSettings | None = None  # set: train from the spool as producers capture (datasets unused)
    training: TrainSettings
    shape: DraftShape
    runtime: RuntimeSettings = Field(default_factory=RuntimeSettings)
    export: ExportSettings | None = None
    init_seed: int | None = None  # drafter init; default training.seed
    pipes_asset_key: str | None = None

    def write(self, path: Path | str) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.model_dump(mode="json"), indent=2))
        return path
