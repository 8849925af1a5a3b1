"""What a training run reports: per-step metrics, the run's summary and the training curve."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


def new_segment(step: int, resumed: bool) -> dict:
    """The figures of one run of a training (a segment), from the step it starts after."""
    return {"first_step": step + 1, "last_step": step, "steps": 0, "tokens": 0, "wall_s": 0.0, "data_s": 0.0,
            "step_s": 0.0, "resumed": resumed}


def add_step(seg: dict, step: int, tokens: int, data_s: float, step_s: float, wall_s: float) -> None:
    """One optimizer step into ``seg``; ``wall_s`` the segment's wall time up to the step's end."""
    seg.update(last_step=step, steps=seg["steps"] + 1, tokens=seg["tokens"] + tokens, wall_s=wall_s,
               data_s=seg["data_s"] + data_s, step_s=seg["step_s"] + step_s)


def segment_from_metrics(metrics: list[dict]) -> dict:
    """The earlier runs' segment of a checkpoint written before segments were recorded, from its
    per-step metrics (wall time unknown there: the steps' own time stands for it)."""
    seg = new_segment(0, resumed=False)
    for m in metrics:
        add_step(seg, m["step"], m.get("tokens", 0), m.get("data_time", 0.0), m.get("step_time", 0.0),
                 seg["wall_s"] + m.get("step_time", 0.0))
    return {**seg, "from_metrics": True}


def segment_totals(segments: list[dict]) -> dict:
    """Totals over a training's segments: what a resumed run reports (no run's figures replace another's)."""
    wall = sum(s["wall_s"] for s in segments)
    step = sum(s["step_s"] for s in segments)
    tokens = sum(s["tokens"] for s in segments)
    return {"steps_trained": sum(s["steps"] for s in segments), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "data_share": sum(s["data_s"] for s in segments) / step if step > 0 else 0.0}


@dataclass
class TrainResult:
    steps: int
    final: dict  # the last step's metrics
    metrics: list[dict]
    checkpoint: Path | None
    metrics_path: Path | None
    curve_path: Path | None
    stopped_early: bool = False
    segments: list[dict] = field(default_factory=list)  # one per run of this training (a resume adds one)
    summary: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        """Real (non-padding) tokens per second of training wall time, all ranks, over every segment."""
        return segment_totals(self.segments)["tokens_per_s"]

    @property
    def data_share(self) -> float:
        """Fraction of step time spent waiting for the next batch, over every segment."""
        return segment_totals(self.segments)["data_share"]

    @property
    def wall_s(self) -> float:
        return segment_totals(self.segments)["wall_s"]

    def summarize(self) -> dict:
        f = self.final
        totals = segment_totals(self.segments)
        return {
            "steps": self.steps,
            "final_loss": f.get("loss"),
            "final_acc_per_step": f.get("acc_per_step"),
            "final_loss_per_step": f.get("loss_per_step"),
            "first_loss": self.metrics[0]["loss"] if self.metrics else None,
            "tokens_per_s": totals["tokens_per_s"],
            "data_share": totals["data_share"],
            "wall_s": totals["wall_s"],
            "steps_trained": totals["steps_trained"],
            "segments": self.segments,
        }


def plot_training_curve(metrics: list[dict], path: Path) -> Path:
    """Loss and top-1 agreement per TTT position against the step, as a PNG."""
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
