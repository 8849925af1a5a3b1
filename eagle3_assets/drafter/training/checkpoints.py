"""Full-state training checkpoints: resume continues bit-for-bit where a run stopped.

``checkpoints/step-XXXXXXXX.pt`` holds the trainable weights, optimizer and scheduler
state, the data position (epoch, batch in epoch), every rank's RNG state, the settings and
the metrics so far (with each checkpoint's acceptance estimate); ``checkpoints/latest`` names
the newest and ``checkpoints/best`` the one with the best estimate, which the rotation keeps
however old it is. Each file is written to a temporary name and renamed, then the pointers
move, so a crash at any point leaves the previous checkpoint whole and pointed to.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from eagle3_assets.files import write_text_atomic

CHECKPOINT_FORMAT = "eagle3-drafter-train-v2"


def checkpoints_dir(out_dir: Path) -> Path:
    return Path(out_dir) / "checkpoints"


def checkpoint_path(out_dir: Path, step: int) -> Path:
    return checkpoints_dir(out_dir) / f"step-{step:08d}.pt"


def latest_checkpoint(out_dir: Path) -> Path | None:
    pointer = checkpoints_dir(out_dir) / "latest"
    if not pointer.exists():
        return None
    path = checkpoints_dir(out_dir) / pointer.read_text().strip()
    return path if path.exists() else None


def save_checkpoint(out_dir: Path, state: dict, keep: int, best_step: int | None = None) -> Path:
    """Write ``state`` as its step's checkpoint; keep the newest ``keep`` and the ``best_step``'s."""
    d = checkpoints_dir(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(out_dir, state["step"])
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save({"format": CHECKPOINT_FORMAT, **state}, tmp)
    os.replace(tmp, path)
    write_text_atomic(d / "latest", path.name)
    best = checkpoint_path(out_dir, best_step).name if best_step is not None else None
    if best is not None:
        write_text_atomic(d / "best", best)
    for old in sorted(d.glob("step-*.pt"))[:-keep] if keep > 0 else []:
        if old.name != best:
            old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: Path) -> dict:
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: not a drafter training checkpoint of format {CHECKPOINT_FORMAT} "
                         f"({state.get('format')!r}); use a fresh out_dir")
    return state
