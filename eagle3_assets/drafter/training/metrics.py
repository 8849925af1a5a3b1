"""What a training run reports: per-step metrics, the run's summary and the training curve."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class TrainResult:
    steps: int
    final: dict  # the last step's metrics
    metrics: list[dict]
    checkpoint: Path | None
    metrics_path: Path | None
    curve_path: Path | None
    tokens_per_s: float  # real (non-padding) tokens per second of wall time in this run, all ranks
    data_share: float  # fraction of step time spent waiting for the next batch
    wall_s: float
    stopped_early: bool = False
    summary: dict = field(default_factory=dict)

    def summarize(self) -> dict:
        f = self.final
        return {
            "steps": self.steps,
            "final_loss": f.get("loss"),
            "final_acc_per_step": f.get("acc_per_step"),
            "final_loss_per_step": f.get("loss_per_step"),
            "first_loss": self.metrics[0]["loss"] if self.metrics else None,
            "tokens_per_s": self.tokens_per_s,
            "data_share": self.data_share,
            "wall_s": self.wall_s,
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
