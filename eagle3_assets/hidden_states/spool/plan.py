"""The spool's plan: every sample the run trains, in the order it trains them, cut into units.

The order is the offline path's own (``ShardBatches``): each epoch is the permutation PyTorch's
``DistributedSampler`` draws (seed + epoch, ``drop_last``), global batch i is positions
``i*B .. (i+1)*B`` of it and rank r takes every world-th of those. The run's positions are the
epochs back to back, cut at the run's last optimizer step, so nothing is planned that is never
trained. A unit is a run of consecutive positions of one dataset (``recapture``) or, with
``keep``, distinct samples in the order of their first use; its bytes are an upper bound known
before capture (tokens x bytes per token plus fixed overheads). Written once, atomically, and only
once the trainer's preflight accepted it; a relaunch with other settings is refused while the run
is unfinished.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from eagle3_assets.files import write_text_atomic
from eagle3_assets.hidden_states.reader import training_order
from eagle3_assets.hidden_states.sizing import bytes_per_token
from eagle3_assets.hidden_states.spool.store import DONE

PLAN = "plan.json"
PLAN_FORMAT = "eagle3-spool-plan-v1"
UNIT_OVERHEAD = 64 << 10  # a unit's manifest, index, journal, settings, shard header, corpus slice header (measured ~20 KB)
SAMPLE_OVERHEAD = 256  # a sample's offsets entry, id in the shard header, index row
CORPUS_BYTES_PER_TOKEN = 5  # the unit's own corpus slice (int32 id + int8 mask) kept beside its states


def train_entries(corpora: dict[str, float], seed: int,
                  split: str = "train") -> tuple[list[str], list[tuple[int, str]], list[dict]]:
    """(corpus names, [(dataset index, sample id)], [{sample id: tokens}] per corpus): the mixture
    as ``ShardDataset`` weighs it (floor(w) copies plus a seeded fraction), each corpus's samples in
    the offline loader's ``training_order`` (longest first, ties by id), not the corpus's row order."""
    import torch

    names = sorted(str(c) for c in corpora)
    weights = {str(c): float(w) for c, w in corpora.items()}
    entries: list[tuple[int, str]] = []
    lengths: list[dict] = []
    for i, name in enumerate(names):
        frame = pl.read_parquet(name, columns=["sample_id", "split", "input_ids"])
        dup = frame.height - frame["sample_id"].n_unique()
        if dup:
            raise ValueError(f"{name}: {dup} duplicate sample ids; the merged corpus must be unique")
        frame = frame.filter(pl.col("split") == split)
        lengths.append(dict(zip(frame["sample_id"].to_list(), frame["input_ids"].list.len().to_list())))
        ids = training_order(lengths[-1])
        w = weights[name]
        whole, frac = int(w), w - int(w)
        entries.extend((i, s) for s in ids * whole)
        if frac > 0 and ids:
            g = torch.Generator().manual_seed(seed * 1000 + i)
            keep = torch.randperm(len(ids), generator=g)[: round(frac * len(ids))]
            entries.extend((i, ids[j]) for j in sorted(keep.tolist()))
    return names, entries, lengths


def epoch_order(n: int, world: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """Entry indices of ``epoch`` in global order: ranks' ``DistributedSampler`` shares interleaved."""
    from torch.utils.data import DistributedSampler

    shares = []
    for r in range(world):
        s = DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=shuffle, seed=seed, drop_last=True)
        s.set_epoch(epoch)
        shares.append(list(s))
    return [shares[r][k] for k in range(len(shares[0])) for r in range(world)]


@dataclass
class Unit:
    id: str
    dataset: int
    samples: list[str]
    tokens: int
    bytes: int
    first_use: int = 0  # the first position that reads it
    last_use: int = 0  # the last one: once the cursor is past it, it is consumed


def unit_bytes(tokens: int, samples: int, per_token: int) -> int:
    """An upper bound of a captured unit's bytes on disk, its temporary folder included."""
    return tokens * (per_token + CORPUS_BYTES_PER_TOKEN) + samples * SAMPLE_OVERHEAD + UNIT_OVERHEAD


class Plan:
    """The plan as loaded: positions -> (entry, unit), and the units with their first and last use."""

    def __init__(self, data: dict):
        self.data = data
        self.corpora: list[str] = data["corpora"]
        self.entries: list[tuple[int, str]] = [tuple(e) for e in data["entries"]]
        self.orders: list[list[int]] = data["orders"]
        self.batch_size, self.world = data["batch_size"], data["world_size"]
        self.epoch_length = data["epoch_length"]
        self.total_positions = sum(len(o) for o in self.orders)
        self.units = [Unit(**{k: u[k] for k in ("id", "dataset", "samples", "tokens", "bytes")}) for u in data["units"]]
        self.by_id = {u.id: u for u in self.units}
        self._unit_of_pos: list[int] = data["unit_of_position"]
        for u in self.units:
            u.first_use, u.last_use = math.inf, -1
        for pos, k in enumerate(self._unit_of_pos):
            u = self.units[k]
            u.first_use, u.last_use = min(u.first_use, pos), max(u.last_use, pos)

    @property
    def cap_bytes(self) -> int:
        return int(self.data["cap_bytes"])

    def sample_at(self, pos: int) -> tuple[int, str]:
        e, k = divmod(pos, self.epoch_length)
        return self.entries[self.orders[e][k]]

    def unit_at(self, pos: int) -> Unit:
        return self.units[self._unit_of_pos[pos]]

    def key(self, pos: int) -> str:
        d, sid = self.sample_at(pos)
        return f"{d}:{sid}"

    def step_range(self, epoch: int, batch: int) -> tuple[int, int]:
        """Positions [lo, hi) of global batch ``batch`` of ``epoch`` (empty past the plan)."""
        base = epoch * self.epoch_length
        end = min(base + self.epoch_length, self.total_positions)
        lo = min(base + batch * self.batch_size, end)
        return lo, min(lo + self.batch_size, end)

    def steps(self) -> list[tuple[int, int]]:
        """Every optimizer step's positions, in order."""
        out = []
        per_epoch = math.ceil(self.epoch_length / self.batch_size) if self.epoch_length else 0
        for e in range(len(self.orders)):
            for b in range(per_epoch):
                lo, hi = self.step_range(e, b)
                if hi > lo:
                    out.append((lo, hi))
        return out


def build_plan(settings, *, seed: int, batch_size: int, world: int, total_steps: int, hidden_size: int,
               max_length: int, n_aux: int = 3) -> dict:
    """The plan's JSON for a run of ``total_steps`` global batches of ``batch_size``."""
    names, entries, lengths = train_entries(settings.corpora, seed)
    n = len(entries)
    length = (n // world) * world  # DistributedSampler's drop_last
    if length == 0:
        raise ValueError(f"the corpora {names} hold {n} train samples: fewer than the {world} rank(s)")
    per_epoch = math.ceil(length / batch_size)
    total = 0
    orders = []
    epoch = 0
    need = total_steps // per_epoch * length + (total_steps % per_epoch) * batch_size  # the last batch of an epoch may be short
    while total < need:
        order = epoch_order(n, world, seed, epoch)
        take = order[: need - total]
        orders.append(take)
        total += len(take)
        epoch += 1
    per_token = bytes_per_token(hidden_size, settings.dtype, n_aux)
    units: list[dict] = []
    unit_of_position: list[int] = []

    def cut(items: list[tuple[int, int]], tag: str) -> None:
        """Consecutive (position, entry) pairs into units: one dataset, distinct ids, within unit_bytes."""
        cur: list[tuple[int, int]] = []
        ids: set[str] = set()

        def close():
            if not cur:
                return
            d = entries[cur[0][1]][0]
            samples = [entries[k][1] for _, k in cur]
            tokens = sum(lengths[d][s] for s in samples)
            units.append({"id": f"{tag}-u{len(units):06d}", "dataset": d, "samples": samples, "tokens": tokens,
                          "bytes": unit_bytes(tokens, len(samples), per_token), "positions": [p for p, _ in cur]})

        for pos, k in items:
            d, sid = entries[k]
            tokens = sum(lengths[entries[j][0]][entries[j][1]] for _, j in cur) + lengths[d][sid]
            if cur and (entries[cur[0][1]][0] != d or sid in ids or
                        unit_bytes(tokens, len(cur) + 1, per_token) > settings.unit_bytes):
                close()
                cur, ids = [], set()
            cur.append((pos, k))
            ids.add(sid)
        close()

    if settings.epochs == "recapture":
        pos = 0
        for e, order in enumerate(orders):
            cut([(pos + i, k) for i, k in enumerate(order)], f"e{e:04d}")
            pos += len(order)
    else:  # keep: each distinct sample once, in the order of its first use
        seen: dict[tuple[int, str], int] = {}
        firsts = []
        pos = 0
        for order in orders:
            for k in order:
                if entries[k] not in seen:
                    seen[entries[k]] = pos
                    firsts.append((pos, k))
                pos += 1
        cut(firsts, "keep")
    holder: dict = {}
    for i, u in enumerate(units):
        for p in u.pop("positions"):
            holder[p] = i
    if settings.epochs == "recapture":
        unit_of_position = [holder[p] for p in range(total)]
    else:
        where = {(units[i]["dataset"], s): i for i in range(len(units)) for s in units[i]["samples"]}
        unit_of_position = [where[entries[k]] for order in orders for k in order]
    return {
        "format": PLAN_FORMAT, "corpora": names, "weights": {str(k): float(v) for k, v in settings.corpora.items()},
        "seed": seed, "batch_size": batch_size, "world_size": world, "total_steps": total_steps,
        "epoch_length": length, "max_length": max_length, "mode": settings.epochs, "dtype": settings.dtype,
        "hidden_size": hidden_size, "n_aux": n_aux, "bytes_per_token": per_token,
        "layer_ids": settings.layer_ids, "cap_bytes": settings.cap_bytes, "high_water": settings.high_water,
        "low_water": settings.low_water, "unit_bytes": settings.unit_bytes, "batch_tokens": settings.batch_tokens,
        "entries": [list(e) for e in entries], "lengths": lengths, "orders": orders, "units": units,
        "unit_of_position": unit_of_position,
    }


def write_plan(spool_dir: Path, plan: dict) -> Plan:
    """Write the plan unless the spool holds it already for an unfinished run (which then resumes). A
    spool whose run finished (``done.json``: nothing in it is still owed to a trainer) is emptied first,
    whatever its plan: a recipe run again with other settings, or with the same ones from scratch,
    captures what it trains. A spool holding another unfinished run's plan is refused (its units and
    cursor belong to that run's resume)."""
    spool_dir = Path(spool_dir)
    spool_dir.mkdir(parents=True, exist_ok=True)
    path = spool_dir / PLAN
    if path.exists():
        old = json.loads(path.read_text())
        done = (spool_dir / DONE).exists()
        if not done and old == json.loads(json.dumps(plan)):
            return Plan(old)
        if not done:
            diff = sorted(k for k in set(old) | set(plan) if old.get(k) != json.loads(json.dumps(plan.get(k))))
            raise ValueError(f"{path}: the spool holds an unfinished run's plan (differs in {', '.join(diff)}); "
                             f"finish that run with its own settings, or delete {spool_dir} to give it up")
        for entry in spool_dir.iterdir():  # the finished run's leftovers: cursor, journal, marker, empty folders
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    write_text_atomic(path, json.dumps(plan))
    return Plan(plan)


def load_plan(spool_dir: Path) -> Plan:
    return Plan(json.loads((Path(spool_dir) / PLAN).read_text()))
