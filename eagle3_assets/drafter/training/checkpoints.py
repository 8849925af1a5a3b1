"""Full-state training checkpoints: resume continues bit-for-bit where a run stopped.

``checkpoints/step-XXXXXXXX.pt`` holds the trainable weights, optimizer and scheduler
state, the data position (epoch, batch in epoch), every rank's RNG state, the settings and
the metrics so far (with each checkpoint's acceptance estimate); ``checkpoints/latest`` names
the newest and ``checkpoints/best`` the one with the best estimate, which the rotation keeps
however old it is. Each file is written to a temporary name and renamed, then the pointers
move, so a crash at any point leaves the previous checkpoint whole and pointed to. The free space
is checked for the state's tensors first, and a disk that fills during the write fails naming the
checkpoint, its temporary file removed.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3_assets.files import atomic_path, is_disk_full, require_free, write_text_atomic

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


def state_bytes(obj) -> int:
    """The tensor bytes of a (nested) state: what ``torch.save`` writes, less its small pickled frame."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def require_room(out_dir: Path, model: torch.nn.Module, keep: int, exports: int) -> dict:
    """Before the first step: room for ``keep`` + 2 checkpoints at once (the newest is written before the
    oldest goes, and the best by the acceptance estimate is kept however old), each the trainable weights
    and at most two optimizer moments in float32, and for ``exports`` exports of the weights, less the
    checkpoints already there (they are replaced)."""
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    exported = sum(v.numel() * 4 for k, v in model.state_dict().items() if not k.startswith("embed_tokens."))
    held = sum(p.stat().st_size for p in checkpoints_dir(out_dir).glob("step-*.pt"))
    return require_free(out_dir, (keep + 2) * 3 * trainable + exports * exported,
                        "the training's checkpoints and exports", held=held)


def save_checkpoint(out_dir: Path, state: dict, keep: int, best_step: int | None = None) -> Path:
    """Write ``state`` as its step's checkpoint; keep the newest ``keep`` and the ``best_step``'s."""
    d = checkpoints_dir(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(out_dir, state["step"])
    with atomic_path(path, need=state_bytes(state), what="a training checkpoint") as tmp, open(tmp, "wb") as fh:
        try:
            torch.save({"format": CHECKPOINT_FORMAT, **state}, fh)
        except RuntimeError as exc:  # torch's zip writer reports the file's own error (a full disk) as its context
            if exc.__context__ is not None and is_disk_full(exc.__context__):
                raise exc.__context__ from exc
            raise
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
