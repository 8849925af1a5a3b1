"""Training data straight from hidden-state shards: nothing of the corpus is held in memory.

``ShardDataset`` is a map-style dataset over one or more ``hidden_states`` directories (one
per recipe dataset, each with its mixing weight). It keeps only an index of (directory,
sample id) entries; ``__getitem__`` reads that sample's rows from its shard through
:class:`~eagle3_assets.hidden_states.reader.ShardReader`, so a process holds a few batches at
a time whatever the corpus size (80M tokens of Kimi-K2.5 features are 4.6 TB).

``ShardBatches`` turns it into epoch-shuffled global batches with PyTorch's
``DistributedSampler`` (seeded per epoch, the same permutation on every rank): global batch
i is a contiguous run of that permutation and rank r gets every world-th sample of it, so
one process and N processes see the same global batches. It starts an epoch at any batch,
which is how resume skips what was trained without reading it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from eagle3_assets.hidden_states.reader import ShardReader

STATE_KEYS = ("aux_hidden", "last_hidden")


class ShardDataset(Dataset):
    """The weighted mixture of the ``split`` samples of several shard directories.

    Weight w keeps floor(w) full copies of a directory's samples plus a seeded random
    fraction (w mod 1) of them. Samples longer than ``max_length`` are cut to it. Each directory's
    samples are in ``training_order`` (longest first, ties by id): what the permutation draws from
    depends on the samples alone, not on how their shards were written.
    """

    def __init__(self, directories: dict[str, float], *, max_length: int, seed: int = 0, split: str = "train"):
        self.max_length = int(max_length)
        self.names = sorted(str(d) for d in directories)
        weights = {str(d): float(w) for d, w in directories.items()}
        self.readers = [ShardReader(Path(d)) for d in self.names]
        self.entries: list[tuple[int, str]] = []
        for i, (name, reader) in enumerate(zip(self.names, self.readers)):
            ids, w = reader.training_ids(split), weights[name]  # the order the streaming plan also takes
            whole, frac = int(w), w - int(w)
            self.entries.extend((i, s) for s in ids * whole)
            if frac > 0 and ids:
                g = torch.Generator().manual_seed(seed * 1000 + i)
                keep = torch.randperm(len(ids), generator=g)[: round(frac * len(ids))]
                self.entries.extend((i, ids[j]) for j in sorted(keep.tolist()))
        self._check_same_features()

    def _check_same_features(self) -> None:
        first = self.readers[0].manifest if self.readers else {}
        for name, reader in zip(self.names[1:], self.readers[1:]):
            for key in ("hidden_size", "n_aux"):
                if reader.manifest.get(key) != first.get(key):
                    raise ValueError(f"{name}: {key} {reader.manifest.get(key)} differs from {self.names[0]}'s "
                                     f"{first.get(key)}: the datasets were extracted from different targets")
            if reader.manifest["layers"]["aux_layer_ids"] != first["layers"]["aux_layer_ids"]:
                raise ValueError(f"{name}: aux layers {reader.manifest['layers']['aux_layer_ids']} differ from "
                                 f"{self.names[0]}'s {first['layers']['aux_layer_ids']}")

    @property
    def aux_layer_ids(self) -> list[int] | None:
        return list(self.readers[0].manifest["layers"]["aux_layer_ids"]) if self.readers else None

    @property
    def hidden_size(self) -> int:
        return int(self.readers[0].manifest["hidden_size"])

    def manifests(self) -> dict[str, dict]:
        return {name: r.manifest for name, r in zip(self.names, self.readers)}

    def verify_files(self, rank: int = 0, world: int = 1, threads: int = 4) -> tuple[list[str], int]:
        """This rank's share (every ``world``-th shard of every directory) checked against the
        sha256 and size its manifest records, before any row of it is read: (problems, bytes)."""
        from eagle3_assets.hidden_states.shard_check import shard_file_problems

        problems, read = [], 0
        for name, reader in zip(self.names, self.readers):
            found, n = shard_file_problems(name, reader.manifest, part=rank, parts=world, threads=threads)
            problems += [f"{p}: re-materialize hidden_states[{Path(name).name}]" for p in found]
            read += n
        return problems, read

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int) -> dict:
        d, sid = self.entries[i]
        reader = self.readers[d]
        shard, off, n = reader.location(sid)
        return {**reader.read_range(shard, off, off + min(n, self.max_length)), "key": f"{d}:{sid}"}

    def close(self) -> None:
        for r in self.readers:
            r.close()

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """Counts [V] of supervised target ids over the mixture (copies counted), as trained
        (cut to ``max_length``). Reads only ids and masks, one slice per shard."""
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        copies: dict[tuple[int, str], int] = {}
        for entry in self.entries:
            copies[entry] = copies.get(entry, 0) + 1
        for d, reader in enumerate(self.readers):
            by_shard: dict[str, list[tuple[int, int, int]]] = {}
            for sid in reader.sample_ids():
                m = copies.get((d, sid), 0)
                if m:
                    shard, off, n = reader.location(sid)
                    by_shard.setdefault(shard, []).append((off, min(n, self.max_length), m))
            for shard, spans in by_shard.items():
                lo, hi = min(a for a, _, _ in spans), max(a + n for a, n, _ in spans)
                ids, mask = reader.read_tokens_range(shard, lo, hi)
                weight = torch.zeros(hi - lo, dtype=torch.int64)
                for a, n, m in spans:
                    weight[a - lo: a - lo + n] = m
                picked = (mask > 0) & (weight > 0)
                ids, weight = ids[picked], weight[picked]
                if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
                    raise ValueError(f"{self.names[d]}/{shard}: token id outside 0..{vocab_size - 1}")
                counts.index_add_(0, ids, weight)
        return counts


def eval_split(directories, *, max_length: int, samples: int) -> ShardDataset | None:
    """At most ``samples`` held-out samples of the shard directories, taken from each in turn and
    each once, whatever its mixing weight (what the acceptance estimate scores); None when there
    are none."""
    data = ShardDataset({d: 1.0 for d in directories}, max_length=max_length, split="eval")
    per_dir = [[e for e in data.entries if e[0] == i] for i in range(len(data.names))]
    data.entries = [e for turn in itertools.zip_longest(*per_dir) for e in turn if e is not None][:samples]
    return data if data.entries else None


def collate(samples: list[dict]) -> dict:
    """Right-pad samples into one batch; ``attention_mask`` marks the real tokens."""
    t = max(int(s["input_ids"].shape[0]) for s in samples)
    b = len(samples)
    batch = {
        "input_ids": torch.zeros(b, t, dtype=torch.long),
        "loss_mask": torch.zeros(b, t, dtype=torch.long),
        "attention_mask": torch.zeros(b, t, dtype=torch.long),
    }
    for k in STATE_KEYS:
        batch[k] = samples[0][k].new_zeros(b, t, samples[0][k].shape[-1])
    for i, s in enumerate(samples):
        n = int(s["input_ids"].shape[0])
        batch["attention_mask"][i, :n] = 1
        for k in ("input_ids", "loss_mask", *STATE_KEYS):
            batch[k][i, :n] = s[k]
    if all("key" in s for s in samples):
        batch["keys"] = [s["key"] for s in samples]  # which sample each row holds (the teacher caches by it)
    return batch


class _FromBatch(DistributedSampler):
    """``DistributedSampler`` that starts ``skip`` samples into this rank's share of the epoch."""

    skip = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.skip:])

    def __len__(self) -> int:
        return super().__len__() - self.skip


def _reset_worker(_worker_id: int) -> None:
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    if info is not None and hasattr(info.dataset, "close"):
        info.dataset.close()  # each worker opens its own shard handles


class ShardBatches:
    """Seeded, epoch-shuffled global batches of a dataset; yields this rank's slice.

    ``len()`` is the number of batches per epoch. The sampler drops the few samples that do
    not divide evenly among the ranks, so every rank runs the same number of steps.
    """

    def __init__(self, dataset: Dataset, batch_size: int, *, seed: int = 0, rank: int = 0, world_size: int = 1,
                 workers: int = 0, pin_memory: bool = False, shuffle: bool = True):
        if batch_size % world_size:
            raise ValueError(f"the global batch {batch_size} does not divide among {world_size} ranks")
        self.dataset, self.batch_size = dataset, batch_size
        self.per_rank = batch_size // world_size
        self.seed, self.rank, self.world_size, self.shuffle = seed, rank, world_size, shuffle
        self.workers, self.pin_memory = workers, pin_memory

    def __len__(self) -> int:
        return math.ceil((len(self.dataset) // self.world_size) / self.per_rank)

    def epoch(self, epoch: int, start: int = 0) -> Iterator[dict]:
        """This rank's batches of ``epoch``, from batch ``start`` on."""
        sampler = _FromBatch(self.dataset, num_replicas=self.world_size, rank=self.rank, shuffle=self.shuffle,
                             seed=self.seed, drop_last=True)
        sampler.set_epoch(epoch)
        sampler.skip = start * self.per_rank
        loader = DataLoader(self.dataset, batch_size=self.per_rank, sampler=sampler, collate_fn=collate,
                            num_workers=self.workers, pin_memory=self.pin_memory,
                            prefetch_factor=4 if self.workers else None, worker_init_fn=_reset_worker)
        yield from loader
