"""The draft vocabulary: which target tokens the drafter's lm_head can propose.

EAGLE-3 drafters predict over the N target tokens that are most frequent in the *supervised*
(loss-masked, assistant) part of the training data. Two tensors describe the choice, in the
layout SGLang and vLLM read:

- ``d2t`` int64 [N]: offsets, ``target_id = draft_id + d2t[draft_id]``;
- ``t2d`` bool [V]: True for the target ids that are in the draft vocabulary.

The map is a function of the token counts, so it is keyed by its size and a hash of those
counts. A map built from other data (a stale ``cache.pt``, a new corpus version) is refused,
never silently reused.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3_assets.files import atomic_path

FORMAT_VERSION = 1


class StaleVocabMapError(ValueError):
    """A stored vocabulary map does not belong to the data or sizes it is used with."""


def count_tokens(samples: Iterable[tuple], target_vocab_size: int) -> torch.Tensor:
    """Counts [V] of the target ids under ``loss_mask`` over ``(input_ids, loss_mask)`` pairs."""
    counts = torch.zeros(target_vocab_size, dtype=torch.int64)
    for ids, mask in samples:
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        mask = torch.as_tensor(mask).reshape(-1).bool()
        picked = ids[mask]
        if picked.numel() and (picked.min() < 0 or picked.max() >= target_vocab_size):
            raise ValueError(f"token id outside 0..{target_vocab_size - 1} in the training data")
        counts += torch.bincount(picked, minlength=target_vocab_size)
    return counts


def counts_hash(counts: torch.Tensor) -> str:
    """Hash of a count table: equal tables (and only those) give equal draft maps."""
    counts = counts.to(torch.int64).contiguous()
    h = hashlib.sha256(f"vocab-counts-v{FORMAT_VERSION}:{counts.numel()}:".encode())
    h.update(counts.numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class VocabMap:
    d2t: torch.Tensor  # int64 [N] offsets
    t2d: torch.Tensor  # bool [V]
    source_hash: str  # counts_hash of the data the map was built from

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.numel())

    @property
    def target_vocab_size(self) -> int:
        return int(self.t2d.numel())

    @property
    def target_ids(self) -> torch.Tensor:
        """Target id of every draft id, ascending: ``arange(N) + d2t``."""
        return torch.arange(self.draft_vocab_size, dtype=torch.int64) + self.d2t

    def file_name(self) -> str:
        return vocab_map_file_name(self.draft_vocab_size, self.source_hash)

    def save(self, directory: Path) -> Path:
        """Write ``vocab_map-d<N>-<hash>.safetensors`` atomically; returns its path."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / self.file_name()
        meta = {
            "format_version": str(FORMAT_VERSION),
            "source_hash": self.source_hash,
            "draft_vocab_size": str(self.draft_vocab_size),
            "target_vocab_size": str(self.target_vocab_size),
        }
        with atomic_path(path) as tmp:
            save_file({"d2t": self.d2t.contiguous(), "t2d": self.t2d.contiguous()}, str(tmp), metadata=meta)
        return path

    def summary(self) -> dict:
        return {
            "draft_vocab_size": self.draft_vocab_size,
            "target_vocab_size": self.target_vocab_size,
            "source_hash": self.source_hash,
            "file": self.file_name(),
        }


def vocab_map_file_name(draft_vocab_size: int, source_hash: str) -> str:
    return f"vocab_map-d{draft_vocab_size}-{source_hash[:16]}.safetensors"


def build_vocab_map(counts: torch.Tensor, draft_vocab_size: int) -> VocabMap:
    """Top-N ids by count; ties go to the lower id, and when fewer than N ids were seen the
    rest is filled with the lowest unseen ids, so the map is a pure function of ``counts``."""
    counts = torch.as_tensor(counts, dtype=torch.int64)
    vocab = counts.numel()
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size must be in 1..{vocab}, got {draft_vocab_size}")
    # A stable sort of -count keeps ascending id order among equal counts.
    order = torch.sort(-counts, stable=True).indices
    chosen = torch.sort(order[:draft_vocab_size]).values
    d2t = chosen - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return VocabMap(d2t=d2t, t2d=t2d, source_hash=counts_hash(counts))


def check_vocab_map(
    vmap: VocabMap,
    *,
    source_hash: str | None = None,
    draft_vocab_size: int | None = None,
    target_vocab_size: int | None = None,
    where: str = "vocabulary map",
) -> VocabMap:
    """Raise ``StaleVocabMapError`` unless ``vmap`` is self-consistent and matches what is expected."""
    n, v = vmap.draft_vocab_size, vmap.target_vocab_size
    if vmap.d2t.dtype != torch.int64 or vmap.t2d.dtype != torch.bool:
        raise StaleVocabMapError(f"{where}: d2t must be int64 and t2d bool, got {vmap.d2t.dtype}/{vmap.t2d.dtype}")
    if draft_vocab_size is not None and n != draft_vocab_size:
        raise StaleVocabMapError(f"{where}: has {n} draft tokens, expected {draft_vocab_size}")
    if target_vocab_size is not None and v != target_vocab_size:
        raise StaleVocabMapError(f"{where}: covers a target vocab of {v}, expected {target_vocab_size}")
    if source_hash is not None and vmap.source_hash != source_hash:
        raise StaleVocabMapError(
            f"{where}: built from data {vmap.source_hash[:16]}, but the training data is {source_hash[:16]}; "
            "rebuild it (a stale map trains the drafter on the wrong vocabulary)"
        )
    ids = vmap.target_ids
    if ids.numel() and (ids.min() < 0 or ids.max() >= v or not bool((ids[1:] > ids[:-1]).all())):
        raise StaleVocabMapError(f"{where}: d2t does not give strictly increasing target ids in 0..{v - 1}")
    if int(vmap.t2d.sum()) != n or not bool(vmap.t2d[ids].all()):
        raise StaleVocabMapError(f"{where}: t2d does not mark exactly the target ids of d2t")
    return vmap


def load_vocab_map(path: Path) -> VocabMap:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata() or {}
        d2t, t2d = fh.get_tensor("d2t"), fh.get_tensor("t2d")
    if meta.get("format_version") != str(FORMAT_VERSION) or "source_hash" not in meta:
        raise StaleVocabMapError(f"{path}: not a vocabulary map of format {FORMAT_VERSION}: {json.dumps(meta)}")
    return check_vocab_map(VocabMap(d2t=d2t, t2d=t2d, source_hash=meta["source_hash"]), where=str(path))


def load_or_build_vocab_map(directory: Path, counts: torch.Tensor, draft_vocab_size: int) -> VocabMap:
    """The map for ``counts`` stored in ``directory``: reused only when its key and contents
    match these counts, else built and saved. Maps of other data sit beside it untouched."""
    source = counts_hash(counts)
    path = Path(directory) / vocab_map_file_name(draft_vocab_size, source)
    if path.exists():
        vmap = load_vocab_map(path)
        return check_vocab_map(
            vmap, source_hash=source, draft_vocab_size=draft_vocab_size,
            target_vocab_size=int(counts.numel()), where=str(path),
        )
    vmap = build_vocab_map(counts, draft_vocab_size)
    vmap.save(directory)
    return vmap
