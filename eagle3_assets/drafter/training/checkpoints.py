"""Full-state training checkpoints: resume continues bit-for-bit where a run stopped.

``checkpoints/step-XXXXXXXX.pt`` holds the trainable weights, optimizer and scheduler
state, the data position (epoch, batch in epoch), every rank's RNG state, the settings and
the metrics so far; ``checkpoints/latest`` names the newest. Each file is written to a
temporary name and renamed, then the pointer moves, so a crash at any point leaves the
previous checkpoint whole and pointed to.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from eagle3_assets.files import write_text_atomic

CHECKPOINT_FORMAT = "eagle3-drafter-train-v2"


def checkpoints_dir(out_dir: Path) -> Path:
    return Path(out_dir) / "checkpoints"


def latest_checkpoint(out_dir: Path) -> Path | None:
    pointer = checkpoints_dir(out_dir) / "latest"
    if not pointer.exists():
        return None
    path = checkpoints_dir(out_dir) / pointer.read_text().strip()
    return path if path.exists() else None


def save_checkpoint(out_dir: Path, state: dict, keep: int) -> Path:
    d = checkpoints_dir(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"step-{state['step']:08d}.pt"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save({"format": CHECKPOINT_FORMAT, **state}, tmp)
    os.replace(tmp, path)
    write_text_atomic(d / "latest", path.name)
    for old in sorted(d.glob("step-*.pt"))[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: Path) -> dict:
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: not a drafter training checkpoint of format {CHECKPOINT_FORMAT} "
                         f"({state.get('format')!r}); use a fresh out_dir")
    return state
