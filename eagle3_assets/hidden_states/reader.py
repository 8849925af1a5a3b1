"""Read hidden-state shards for training: by sample id, or as padded / packed batches.

A sample costs only its own rows: they are read with ``pread`` into fresh memory
(:class:`~eagle3_assets.hidden_states.shard_file.ShardFile`, no memory map whose touched
pages would stay in the process), and a run of consecutive samples of one shard is read with
one call per tensor. fp8 shards are dequantized on read.

Packed batches concatenate whole samples up to a token budget: ``position_ids`` restart at
0 for each sample and ``cu_seqlens`` holds the boundaries. A trainer that shifts targets by
one token must not shift across those boundaries.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from eagle3_assets.hidden_states.encoding import dequantize_fp8
from eagle3_assets.hidden_states.shards import INDEX, MANIFEST


def training_order(lengths: dict[str, int]) -> list[str]:
    """The order training draws its permutation over: longest first, ties by sample id. It is the shard
    order a one-pass extraction writes, made a function of the samples alone, so that neither how the
    shards were made (resumed, in parts, retried) nor the corpus's row order changes what is trained,
    and the streaming plan, which has no shards, computes the same order from the corpus."""
    return sorted(lengths, key=lambda s: (-lengths[s], s))


@dataclass
class Sample:
    sample_id: str
    split: str
    input_ids: object  # int64 [T]
    loss_mask: object  # int64 [T]
    aux_hidden: object  # [T, 3H]
    last_hidden: object  # [T, H]

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


class ShardReader:
    """Random and sequential access to one hidden-state directory (manifest + index + shards)."""

    def __init__(self, directory: Path | str, *, dtype=None):
        import torch

        self.dir = Path(directory)
        manifest_path = self.dir / MANIFEST
        if not manifest_path.exists():
            raise FileNotFoundError(f"{manifest_path} is missing: extraction never finished here")
        self.manifest = json.loads(manifest_path.read_text())
        self.index = pl.read_parquet(self.dir / self.manifest.get("index", INDEX))
        self.hidden_size = int(self.manifest["hidden_size"])
        self.stored = self.manifest["dtype"]
        self.dtype = dtype if dtype is not None else torch.bfloat16
        stored = self.index.filter(~pl.col("quarantined"))
        self._rows = {
            sid: (shard, int(off), int(n), split)
            for sid, shard, off, n, split in stored.select("sample_id", "shard", "offset", "length", "split").iter_rows()
        }
        self._order = stored.sort("shard", "offset")["sample_id"].to_list()
        self._handles: dict[str, object] = {}

    # -- basics ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self._rows

    def sample_ids(self, split: str | None = None) -> list[str]:
        """Stored ids in shard order (sequential reads), optionally of one split."""
        if split is None:
            return list(self._order)
        return [s for s in self._order if self._rows[s][3] == split]

    def training_ids(self, split: str | None = None) -> list[str]:
        """Stored ids (optionally of one split) in :func:`training_order`."""
        return training_order({s: r[2] for s, r in self._rows.items() if split is None or r[3] == split})

    @property
    def quarantined(self) -> pl.DataFrame:
        return self.index.filter(pl.col("quarantined"))

    def _open(self, shard: str):
        h = self._handles.get(shard)
        if h is None:
            from eagle3_assets.hidden_states.shard_file import ShardFile

            h = ShardFile(self.dir / shard)
            self._handles[shard] = h
        return h

    def close(self) -> None:
        for h in self._handles.values():
            h.close()
        self._handles.clear()

    def __getstate__(self) -> dict:
        # Open shard handles stay with the process that opened them (DataLoader workers open their own).
        return {**self.__dict__, "_handles": {}}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- reading --------------------------------------------------------------------------

    def _states(self, h, name: str, a: int, b: int):
        x = h.rows(f"{name}_hidden", a, b)
        if self.stored == "fp8":
            return dequantize_fp8(x, h.rows(f"{name}_scale", a, b), self.dtype)
        return x if x.dtype == self.dtype else x.to(self.dtype)

    def read_range(self, shard: str, start: int, end: int) -> dict:
        """Tokens ``start:end`` of one shard, every tensor, states in the reader's dtype."""
        import torch

        h = self._open(shard)
        return {
            "input_ids": h.rows("input_ids", start, end).to(torch.int64),
            "loss_mask": h.rows("loss_mask", start, end).to(torch.int64),
            "aux_hidden": self._states(h, "aux", start, end),
            "last_hidden": self._states(h, "last", start, end),
        }

    def read_tokens_range(self, shard: str, start: int, end: int) -> tuple:
        """``input_ids`` and ``loss_mask`` (int64) of tokens ``start:end``, without the states."""
        import torch

        h = self._open(shard)
        return h.rows("input_ids", start, end).to(torch.int64), h.rows("loss_mask", start, end).to(torch.int64)

    def location(self, sample_id: str) -> tuple[str, int, int]:
        """(shard file, first token, length) of a stored sample."""
        shard, off, n, _ = self._rows[sample_id]
        return shard, off, n

    def read(self, sample_id: str) -> Sample:
        try:
            shard, off, n, split = self._rows[sample_id]
        except KeyError:
            raise KeyError(f"sample {sample_id} is not stored in {self.dir} (quarantined or absent)") from None
        t = self.read_range(shard, off, off + n)
        return Sample(sample_id, split, t["input_ids"], t["loss_mask"], t["aux_hidden"], t["last_hidden"])

    def iter_samples(self, ids: list[str] | None = None, *, read_tokens: int = 1 << 16) -> Iterator[Sample]:
        """Samples in the given order; runs adjacent in one shard are read in one slice."""
        ids = self.sample_ids() if ids is None else ids
        i = 0
        while i < len(ids):
            shard, start, n, _ = self._rows[ids[i]]
            j, end = i + 1, start + n
            while j < len(ids):
                s2, o2, n2, _ = self._rows[ids[j]]
                if s2 != shard or o2 != end or end + n2 - start > read_tokens:
                    break
                end += n2
                j += 1
            t = self.read_range(shard, start, end)
            for sid in ids[i:j]:
                _, off, length, split = self._rows[sid]
                a, b = off - start, off - start + length
                yield Sample(sid, split, t["input_ids"][a:b], t["loss_mask"][a:b],
                             t["aux_hidden"][a:b], t["last_hidden"][a:b])
            i = j

    def _ordered(self, split: str | None, shuffle: bool, seed: int) -> list[str]:
        ids = self.sample_ids(split)
        if shuffle:
            random.Random(seed).shuffle(ids)
        return ids

    def iter_batches(self, batch_size: int, *, split: str | None = None, shuffle: bool = False, seed: int = 0,
                     pad_id: int = 0, drop_last: bool = False) -> Iterator[dict]:
        """Right-padded batches: [B, Tmax] ids/masks/positions, [B, Tmax, 3H] and [B, Tmax, H] states."""
        ids = self._ordered(split, shuffle, seed)
        buf: list[Sample] = []
        for s in self.iter_samples(ids):
            buf.append(s)
            if len(buf) == batch_size:
                yield self._pad(buf, pad_id)
                buf = []
        if buf and not drop_last:
            yield self._pad(buf, pad_id)

    def iter_packed(self, token_budget: int, *, split: str | None = None, shuffle: bool = False,
                    seed: int = 0) -> Iterator[dict]:
        """Whole samples concatenated up to ``token_budget`` tokens (a longer sample goes alone)."""
        ids = self._ordered(split, shuffle, seed)
        buf: list[Sample] = []
        used = 0
        for s in self.iter_samples(ids):
            if buf and used + len(s) > token_budget:
                yield self._pack(buf)
                buf, used = [], 0
            buf.append(s)
            used += len(s)
        if buf:
            yield self._pack(buf)

    def _pad(self, samples: list[Sample], pad_id: int) -> dict:
        import torch

        b, t = len(samples), max(len(s) for s in samples)
        h = self.hidden_size
        w = samples[0].aux_hidden.shape[1]
        out = {
            "input_ids": torch.full((b, t), pad_id, dtype=torch.int64),
            "attention_mask": torch.zeros((b, t), dtype=torch.int64),
            "loss_mask": torch.zeros((b, t), dtype=torch.int64),
            "position_ids": torch.zeros((b, t), dtype=torch.int64),
            "aux_hidden": torch.zeros((b, t, w), dtype=self.dtype),
            "last_hidden": torch.zeros((b, t, h), dtype=self.dtype),
        }
        for i, s in enumerate(samples):
            n = len(s)
            out["input_ids"][i, :n] = s.input_ids
            out["attention_mask"][i, :n] = 1
            out["loss_mask"][i, :n] = s.loss_mask
            out["position_ids"][i, :n] = torch.arange(n)
            out["aux_hidden"][i, :n] = s.aux_hidden
            out["last_hidden"][i, :n] = s.last_hidden
        out["lengths"] = torch.tensor([len(s) for s in samples], dtype=torch.int64)
        out["sample_ids"] = [s.sample_id for s in samples]
        return out

    def _pack(self, samples: list[Sample]) -> dict:
        import torch

        lengths = [len(s) for s in samples]
        cu = torch.zeros(len(samples) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
        return {
            "input_ids": torch.cat([s.input_ids for s in samples]).unsqueeze(0),
            "loss_mask": torch.cat([s.loss_mask for s in samples]).unsqueeze(0),
            "position_ids": torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0),
            "aux_hidden": torch.cat([s.aux_hidden for s in samples]).unsqueeze(0),
            "last_hidden": torch.cat([s.last_hidden for s in samples]).unsqueeze(0),
            "cu_seqlens": cu,
            "lengths": torch.tensor(lengths, dtype=torch.int64),
            "sample_ids": [s.sample_id for s in samples],
        }
