"""Training from the spool: samples in plan order as producers publish them, consumed once.

``StreamDataset`` stands where ``ShardDataset`` stands offline, before any state is captured:
its samples and their token counts (for the vocabulary map) come from the corpus parquet, which
holds the input ids without any hidden state. ``StreamBatches`` yields this rank's share of each
global batch exactly as ``ShardBatches`` does (the same permutation, the same collate, rank r
takes every world-th sample), reading each sample from its published unit and waiting while it
is not (the wait is recorded). Each batch carries a ``record`` of the positions and sample ids
the step consumes; the trainer puts it into the step's metrics, which the checkpoint holds, so
what was trained is durable and atomic with the weights. ``after_step`` (every rank, after the
optimizer step) closes the units the step finished, and rank 0, after a barrier, moves the
cursor and deletes them; a resumed run first moves the cursor back to its checkpoint, so units
deleted after it are captured again.

A unit is read back against its manifest (each shard's size and sha256) before any of it is
trained on; one that fails is removed, so a producer captures it again (a unit rotten on disk
neither trains NaNs nor fails every rerun the same way). A wait ends at once when the spool
records that the run cannot go on (``failed.json``: a producer found the disk full, or no
producer is left), with that message.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch

from eagle3_assets.drafter.training.data import collate
from eagle3_assets.drafter.training.distributed import barrier
from eagle3_assets.hidden_states.spool.plan import Plan, build_plan, train_entries, write_plan
from eagle3_assets.hidden_states.spool.store import Spool, unit_problem, write_json_atomic

LAYERS = "stream_layers.json"  # in the training's folder: the aux layers every unit held (drafter_acceptance reads it)
MAX_RECAPTURES = 3  # a unit that fails its read-back this often is an error, not bad luck


class StreamFailed(RuntimeError):
    """The spool says the run cannot go on (``failed.json``), or a unit fails its read-back again and again."""


class StreamDataset:
    """The mixture of the corpora's train samples, known from the corpus parquet alone."""

    readers: list = []  # no shard directory behind it (``drafter_config`` checks widths on the first unit)

    def __init__(self, settings, *, max_length: int, seed: int, target_layers: int):
        from eagle3_assets.target.layers import resolve_layer_ids

        self.settings, self.max_length, self.seed = settings, int(max_length), seed
        self.names, self.entries, self.lengths = train_entries(settings.corpora, seed)
        self.aux_layer_ids = resolve_layer_ids(target_layers, settings.layer_ids)

    def __len__(self) -> int:
        return len(self.entries)

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """Counts [V] of supervised ids over the mixture as trained (copies counted, cut to ``max_length``):
        what ``ShardDataset.token_counts`` gives for the same samples, from the parquet."""
        import polars as pl

        counts = torch.zeros(vocab_size, dtype=torch.int64)
        copies: dict[tuple[int, str], int] = {}
        for e in self.entries:
            copies[e] = copies.get(e, 0) + 1
        for d, name in enumerate(self.names):
            frame = pl.read_parquet(name, columns=["sample_id", "input_ids", "loss_mask"])
            for sid, ids, mask in frame.iter_rows():
                m = copies.get((d, sid), 0)
                if not m:
                    continue
                ids = torch.tensor(ids[: self.max_length], dtype=torch.int64)
                picked = ids[torch.tensor(mask[: self.max_length], dtype=torch.int64) > 0]
                if picked.numel() and (picked.min() < 0 or picked.max() >= vocab_size):
                    raise ValueError(f"{name}: sample {sid}: token id outside 0..{vocab_size - 1}")
                counts.index_add_(0, picked, torch.full_like(picked, m))
        return counts


class StreamBatches:
    """This rank's batches of the plan, read from the spool; ``len()`` batches per epoch as offline."""

    def __init__(self, plan: Plan, spool: Spool, *, rank: int = 0, world_size: int = 1, max_length: int,
                 poll_s: float = 0.05, log_every_s: float = 60.0, wait_timeout_s: float | None = None,
                 layers_record: Path | None = None):
        self.plan, self.spool, self.rank, self.world = plan, spool, rank, world_size
        self.max_length, self.poll_s, self.log_every_s = int(max_length), poll_s, log_every_s
        self.wait_timeout_s = wait_timeout_s  # None: wait as long as it takes (producers may be relaunched)
        self.layers_record = layers_record  # rank 0 writes the units' layers there (None: nowhere)
        self.readers: dict[str, object] = {}
        self.aux_layer_ids: list[int] | None = None  # the drafter's (set by ``open_stream``)
        self.wait_s = 0.0  # time spent waiting for units to be published
        self.read_s = 0.0
        self.verify_s = 0.0  # reading units back against their digests
        self.rotten: dict[str, int] = {}  # unit -> times it failed its read-back and was captured again
        self._started = False
        self._layers_written = False

    def __len__(self) -> int:
        return math.ceil(self.plan.epoch_length / self.plan.batch_size)

    # -- reading --------------------------------------------------------------------------

    def _reader(self, uid: str):
        r = self.readers.get(uid)
        if r is not None:
            return r
        from eagle3_assets.hidden_states.reader import ShardReader

        path = self.spool.unit_dir(uid)
        while True:
            self._wait_for(uid, path)
            t0 = time.perf_counter()
            problem = unit_problem(path)
            if problem is None:
                try:
                    r = ShardReader(path)
                    listed = set(r.index["sample_id"].to_list())
                    if missing := [s for s in self.plan.by_id[uid].samples if s not in listed]:
                        problem = f"its index lacks {len(missing)} of its samples, e.g. {missing[0]}"
                except Exception as exc:  # an index or manifest that does not parse
                    problem = f"it cannot be opened ({exc})"
            self.verify_s += time.perf_counter() - t0
            if problem is None:
                break
            self._recapture(uid, path, problem)
        self.readers[uid] = r
        hidden, n_aux = self.plan.data["hidden_size"], self.plan.data["n_aux"]
        if int(r.manifest["hidden_size"]) != hidden or int(r.manifest["n_aux"]) != n_aux:
            raise ValueError(f"{path}: hidden size {r.manifest['hidden_size']} x {r.manifest['n_aux']} aux, the plan's "
                             f"is {hidden} x {n_aux}: the producer runs another target")
        self._check_layers(path, r.manifest["layers"])
        return r

    def _wait_for(self, uid: str, path: Path) -> None:
        """Until the unit is published; at once :class:`StreamFailed` when the spool records a failure."""
        t0, last_log = time.perf_counter(), time.perf_counter()
        while not path.is_dir():
            if (failed := self.spool.failed()) is not None:
                raise StreamFailed(f"{self.spool.root}: the stream cannot go on ({failed.get('by')}): {failed.get('error')}")
            time.sleep(self.poll_s)
            if self.wait_timeout_s is not None and time.perf_counter() - t0 > self.wait_timeout_s:
                raise TimeoutError(f"{path}: unit not published after {self.wait_timeout_s:.0f} s (stream.wait_timeout_s)")
            if time.perf_counter() - last_log > self.log_every_s:
                last_log = time.perf_counter()
                leases = self.spool.leases()
                who = leases[uid].get("producer") if uid in leases else "no producer holds it (are producers running?)"
                print(f"eagle3: stream: waiting for unit {uid} ({who}), {time.perf_counter() - t0:.0f} s",
                      file=sys.stderr, flush=True)
        self.wait_s += time.perf_counter() - t0

    def _recapture(self, uid: str, path: Path, problem: str) -> None:
        """A unit that fails its read-back goes (out of the namespace, under the lock): a producer captures it again."""
        self.rotten[uid] = self.rotten.get(uid, 0) + 1
        if self.rotten[uid] > MAX_RECAPTURES:
            raise StreamFailed(f"{path}: failed its read-back {self.rotten[uid]} times, the last: {problem}; "
                               "the spool's disk may be failing")
        print(f"eagle3: stream: unit {uid} failed its read-back ({problem}); removed, to be captured again",
              file=sys.stderr, flush=True)
        with self.spool.lock():
            self.spool.remove_unit(uid)

    def _check_layers(self, path: Path, layers: dict) -> None:
        """Every unit holds the layers the drafter is built for; rank 0 records them beside the training
        (``stream_layers.json``), where the acceptance check reads what the drafter was trained on."""
        if list(layers["aux_layer_ids"]) != list(self.aux_layer_ids or layers["aux_layer_ids"]):
            raise ValueError(f"{path}: aux layers {layers['aux_layer_ids']}, the drafter's are {self.aux_layer_ids}: "
                             "the producer captures other layers")
        if self.rank == 0 and self.layers_record is not None and not self._layers_written:
            write_json_atomic(self.layers_record, layers)
            self._layers_written = True

    def sample(self, pos: int) -> dict | None:
        """The sample at ``pos``, cut to ``max_length``; None when its unit quarantined it."""
        d, sid = self.plan.sample_at(pos)
        reader = self._reader(self.plan.unit_at(pos).id)
        if sid not in reader:
            return None
        t0 = time.perf_counter()
        shard, off, n = reader.location(sid)
        out = {**reader.read_range(shard, off, off + min(n, self.max_length)), "key": f"{d}:{sid}"}
        self.read_s += time.perf_counter() - t0
        return out

    def epoch(self, epoch: int, start: int = 0):
        """This rank's batches of ``epoch`` from global batch ``start`` on; the first call of a run
        moves the spool's cursor to where the run starts (a resumed run: its checkpoint's position)."""
        lo0, _ = self.plan.step_range(epoch, start)
        if not self._started:
            self._started = True
            if self.rank == 0:
                with self.spool.lock():
                    self.spool.write_cursor(lo0)
            barrier()
        for b in range(start, len(self)):
            lo, hi = self.plan.step_range(epoch, b)
            if hi <= lo:
                return
            samples, quarantined = [], []
            for pos in range(lo + self.rank, hi, self.world):
                s = self.sample(pos)
                if s is None:
                    quarantined.append(self.plan.key(pos))
                else:
                    samples.append(s)
            if not samples:
                raise ValueError(f"every sample of rank {self.rank}'s share of positions {lo}..{hi} was quarantined "
                                 "(non-finite states): nothing to train this step on")
            batch = collate(samples)
            batch["record"] = {"positions": [lo, hi], "ids": [self.plan.key(p) for p in range(lo, hi)],
                               "quarantined": quarantined}
            yield batch

    # -- after each optimizer step ----------------------------------------------------------

    def after_step(self, metrics: dict) -> None:
        """Every rank past the step (barrier): the step's finished units are closed here, and rank 0
        moves the cursor past the step's positions and deletes every unit it consumed."""
        record = metrics.get("consumed")
        if not record:
            return
        hi = record["positions"][1]
        for uid in [u for u in self.readers if self.plan.by_id[u].last_use < hi]:
            self.readers.pop(uid).close()
        barrier()
        if self.rank == 0:
            with self.spool.lock():
                self.spool.write_cursor(hi, metrics.get("step"))
                self.spool.sweep(self.plan, hi)

    def close(self) -> None:
        for r in self.readers.values():
            r.close()
        self.readers.clear()


def open_stream(settings, training, *, rank: int, world: int, target_config: dict, out_dir: Path | None = None):
    """The dataset, the plan (rank 0 writes it, or finds the same one there) and this rank's batches.

    Rank 0 checks the plan before writing it: a cap below one step's units, or above what the spool's
    filesystem can hold, is refused with no plan written, so producers capture nothing for it and a
    later run with a workable cap is not held up by it. ``out_dir``: the training's folder (where the
    units' layers are recorded)."""
    import json

    from eagle3_assets.hidden_states.spool.preflight import PREFLIGHT, check_cap, check_disk, preflight_line, stream_preflight
    from eagle3_assets.target.config import text_config

    text = text_config(target_config)  # a multimodal wrapper's (kimi-mini, Kimi-K2.5) language model settings
    dataset = StreamDataset(settings, max_length=training.max_length, seed=training.seed,
                            target_layers=int(text["num_hidden_layers"]))
    world_len = (len(dataset) // world) * world
    per_epoch = math.ceil(world_len / training.batch_size) if world_len else 1
    total_steps = training.total_steps(per_epoch)
    spool_dir = Path(settings.spool_dir)
    if rank == 0:
        spool_dir.mkdir(parents=True, exist_ok=True)
        Spool(spool_dir).clear_failed()  # an earlier attempt's failure; producers only capture once the plan is there
        data = build_plan(settings, seed=training.seed, batch_size=training.batch_size, world=world,
                          total_steps=total_steps, hidden_size=int(text["hidden_size"]),
                          max_length=training.max_length)
        figures = stream_preflight(Plan(data), spool_dir=spool_dir, plan_bytes=len(json.dumps(data)),
                                   capture_tokens_per_s=settings.capture_tokens_per_s,
                                   train_tokens_per_s=settings.train_tokens_per_s)
        print(preflight_line(figures), file=sys.stderr, flush=True)
        try:
            check_cap(figures)
            check_disk(figures, spool_dir)
            plan = write_plan(spool_dir, data)  # may empty a finished run's spool first
        finally:
            write_json_atomic(spool_dir / PREFLIGHT, figures)  # for the step to show, a refused cap too
    barrier()
    if rank != 0:
        from eagle3_assets.hidden_states.spool.plan import load_plan

        plan = load_plan(spool_dir)
    data = StreamBatches(plan, Spool(spool_dir), rank=rank, world_size=world, max_length=training.max_length,
                         poll_s=settings.poll_s, wait_timeout_s=settings.wait_timeout_s,
                         layers_record=Path(out_dir) / LAYERS if out_dir is not None else None)
    data.aux_layer_ids = list(dataset.aux_layer_ids)
    return dataset, plan, data


def finish_stream(data: StreamBatches, result, rank: int) -> dict:
    """After the run: a finished run marks the spool done (producers stop) and empties it of consumed units."""
    data.close()
    if rank == 0 and not result.stopped_early:
        with data.spool.lock():
            data.spool.sweep(data.plan)
            data.spool.reclaim()
            data.spool.mark_done({"steps": result.steps, "positions": data.spool.cursor()})
    return {"wait_s": round(data.wait_s, 3), "read_s": round(data.read_s, 3), "verify_s": round(data.verify_s, 3),
            "units_recaptured": sum(data.rotten.values()), "units": len(data.plan.units),
            "positions": data.plan.total_positions, "cap_bytes": data.plan.cap_bytes}
