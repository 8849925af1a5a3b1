"""Hidden-state shards: many samples packed along the token axis in safetensors files.

One shard holds ``input_ids`` [N] int32, ``loss_mask`` [N] int8, ``aux_hidden`` [N, 3H],
``last_hidden`` [N, H] and ``offsets`` [S+1] int64 (sample starts, token axis), plus
``aux_scale``/``last_scale`` [N] float32 in fp8 mode. The sample ids ride in the safetensors
metadata so a shard describes itself. bf16 costs 8H bytes per token; fp8 (e4m3, one scale per
token and tensor, scale = amax/448) costs 4H + 8.

Crash safety: a shard is streamed to a temporary file, fsync'd and renamed into place, and only
then recorded in ``progress.jsonl`` (one fsync'd line per shard). On restart, shards listed there
are kept untouched; samples that were buffered for an unfinished shard are simply redone, and a
shard file that never made it into the progress file is removed. Several shards may be in flight
at once (``max_inflight`` writer threads): each is recorded when its own fsync is done, whatever
the order, so a kill loses the shards in flight and never records a sample twice. Samples whose states are not
finite are quarantined: recorded in the progress file, the index and the manifest, never written
and never silently dropped.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from eagle3_assets.files import atomic_path, disk_full_names, fsync_dir, write_parquet_atomic
from eagle3_assets.hidden_states.encoding import encode_ids, encode_sample, write_safetensors
from eagle3_assets.hidden_states.journal import now_iso, read_progress
from eagle3_assets.hidden_states.sizing import check_dtype

FORMAT = "eagle3-hidden-states/1"
SHARD_RE = re.compile(r"^shard-(\d{5,})\.safetensors$")
PROGRESS = "progress.jsonl"
SETTINGS = "settings.json"
INDEX = "index.parquet"
MANIFEST = "manifest.json"
# Settings that must agree between a run and the shards already on disk.
SETTINGS_KEYS = ("format", "dtype", "hidden_size", "n_aux", "target", "layers")
INDEX_SCHEMA = {
    "sample_id": pl.Utf8, "split": pl.Utf8, "shard": pl.Utf8, "sample_pos": pl.Int32,
    "offset": pl.Int64, "length": pl.Int32, "quarantined": pl.Boolean, "reason": pl.Utf8,
}


@dataclass
class _Pending:
    sample_id: str
    split: str
    tensors: dict
    tokens: int
    nbytes: int


@dataclass
class WriterStats:
    shards_kept: int = 0
    shards_written: int = 0
    shards_dropped: int = 0  # listed in progress but missing/short on disk: their samples redo
    orphans_removed: int = 0
    samples_written: int = 0
    tokens_written: int = 0
    quarantined_new: int = 0
    write_seconds: float = 0.0
    dropped_files: list = field(default_factory=list)


class ShardWriter:
    """Accumulates samples, writes a shard whenever ``shard_bytes`` would be exceeded.

    Shard writes run on ``max_inflight`` background threads, so extraction of the next batches
    overlaps the write, hash and fsync of earlier shards, and one shard's fsync overlaps the next
    one's write. A full queue makes :meth:`flush` wait for the oldest shard, so the host holds at
    most ``(1 + max_inflight) * shard_bytes`` of buffered samples.
    """

    def __init__(
        self,
        out_dir: Path | str,
        *,
        hidden_size: int,
        dtype: str = "bf16",
        shard_bytes: int = 1 << 30,
        n_aux: int = 3,
        meta: dict | None = None,
        background: bool = True,
        max_inflight: int = 2,
    ):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.hidden = int(hidden_size)
        self.n_aux = n_aux
        self.dtype = check_dtype(dtype)
        self.shard_bytes = int(shard_bytes)
        self.meta = dict(meta or {})
        self.stats = WriterStats()
        self._pending: list[_Pending] = []
        self._pending_bytes = 0
        self._pending_ids: set[str] = set()
        self.max_inflight = max(1, int(max_inflight))
        self._pool = concurrent.futures.ThreadPoolExecutor(self.max_inflight, "shard-writer") if background else None
        self._inflight: collections.deque[concurrent.futures.Future] = collections.deque()
        self._lock = threading.Lock()  # the progress file and the records the writer threads update
        self.wait_seconds = 0.0  # time the caller spent waiting for a free writer (the queue was full)
        self._settings = self._check_settings()
        self._load()

    # -- resume ---------------------------------------------------------------------------

    def _check_settings(self) -> dict:
        wanted = {"format": FORMAT, "dtype": self.dtype, "hidden_size": self.hidden, "n_aux": self.n_aux,
                  "target": self.meta.get("target"), "layers": self.meta.get("layers")}
        path = self.dir / SETTINGS
        if path.exists():
            old = json.loads(path.read_text())
            diff = [k for k in SETTINGS_KEYS if old.get(k) != wanted.get(k)]
            if diff:
                raise ValueError(
                    f"{self.dir} holds hidden states made with different settings ({', '.join(diff)}); "
                    "remove the directory or choose another one"
                )
            return old
        wanted["created_at"] = now_iso()
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(wanted, indent=2, sort_keys=True))
        return wanted

    def _load(self) -> None:
        for p in self.dir.glob(".shard-*.tmp*"):
            p.unlink(missing_ok=True)
        records = read_progress(self.dir / PROGRESS)
        self.shards: list[dict] = []
        self.quarantined: dict[str, dict] = {}
        kept: list[dict] = []
        for rec in records:
            if rec["kind"] == "shard":
                p = self.dir / rec["file"]
                if p.exists() and p.stat().st_size == rec["bytes"]:
                    self.shards.append(rec)
                    kept.append(rec)
                else:
                    self.stats.shards_dropped += 1
                    self.stats.dropped_files.append(rec["file"])
            elif rec["kind"] == "quarantine":
                self.quarantined[rec["sample_id"]] = rec
                kept.append(rec)
        if self.stats.shards_dropped:  # rewrite progress without the shards that are gone
            self._rewrite_progress(kept)
        listed = {r["file"] for r in self.shards}
        for p in self.dir.glob("shard-*.safetensors"):
            if p.name not in listed:
                p.unlink()
                self.stats.orphans_removed += 1
        self.done_ids = {s[0] for r in self.shards for s in r["samples"]}
        for sid in list(self.quarantined):
            if sid in self.done_ids:
                del self.quarantined[sid]
        self.stats.shards_kept = len(self.shards)
        nums = [int(SHARD_RE.match(r["file"]).group(1)) for r in self.shards]
        self._next = max(nums, default=-1) + 1

    def _rewrite_progress(self, records: list[dict]) -> None:
        with atomic_path(self.dir / PROGRESS) as tmp:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in records))

    def _append_progress(self, record: dict) -> None:
        # a full disk mid-line tears the last line, which the next reader cuts off: that shard is redone
        with self._lock, disk_full_names(self.dir / PROGRESS), open(self.dir / PROGRESS, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    # -- adding samples --------------------------------------------------------------------

    def is_done(self, sample_id: str) -> bool:
        with self._lock:
            return sample_id in self.done_ids or sample_id in self.quarantined or sample_id in self._pending_ids

    def _check(self, sample_id: str, t: int, aux, last, mask_len: int) -> None:
        if self.is_done(sample_id):
            raise ValueError(f"sample {sample_id} is already stored, queued or quarantined")
        width = self.n_aux * self.hidden
        if tuple(aux.shape) != (t, width) or tuple(last.shape) != (t, self.hidden) or mask_len != t:
            raise ValueError(
                f"sample {sample_id}: expected aux [{t}, {width}], last [{t}, {self.hidden}], "
                f"mask [{t}]; got {tuple(aux.shape)}, {tuple(last.shape)}, [{mask_len}]"
            )

    def add(self, sample_id: str, split: str, input_ids, loss_mask, aux, last) -> None:
        """Queue one sample's states ([T, 3H] and [T, H]); may write a shard."""
        self._check(sample_id, len(input_ids), aux, last, len(loss_mask))
        self._queue(sample_id, split, encode_sample(input_ids, loss_mask, aux, last, self.dtype))

    def add_encoded(self, sample_id: str, split: str, input_ids, loss_mask, states: dict) -> None:
        """Queue one sample whose states are storage tensors already (:mod:`~.staging`'s row views:
        ``aux_hidden``, ``last_hidden`` and in fp8 their scales, on the host); may write a shard."""
        self._check(sample_id, len(input_ids), states["aux_hidden"], states["last_hidden"], len(loss_mask))
        want = {"aux_hidden", "last_hidden"} | ({"aux_scale", "last_scale"} if self.dtype == "fp8" else set())
        if set(states) != want:
            raise ValueError(f"sample {sample_id}: {self.dtype} storage needs {sorted(want)}, got {sorted(states)}")
        self._queue(sample_id, split, {**encode_ids(input_ids, loss_mask), **states})

    def _queue(self, sample_id: str, split: str, tensors: dict) -> None:
        t = int(tensors["input_ids"].shape[0])
        nbytes = sum(x.numel() * x.element_size() for x in tensors.values()) + 8
        if self._pending and self._pending_bytes + nbytes > self.shard_bytes:
            self.flush()
        self._pending.append(_Pending(sample_id, split, tensors, t, nbytes))
        with self._lock:
            self._pending_ids.add(sample_id)
        self._pending_bytes += nbytes

    def quarantine(self, sample_id: str, split: str, length: int, reason: str) -> None:
        """Record a sample that will not be written, with why; it is listed, never lost."""
        rec = {"kind": "quarantine", "sample_id": sample_id, "split": split, "length": int(length),
               "reason": reason, "at": now_iso()}
        self._append_progress(rec)  # under the lock the writer threads append with
        self.quarantined[sample_id] = rec
        self.stats.quarantined_new += 1

    # -- writing shards --------------------------------------------------------------------

    def _wait(self, keep: int = 0) -> None:
        """Until at most ``keep`` shards are in flight (oldest first); a failed write raises here."""
        while len(self._inflight) > keep:
            fut = self._inflight.popleft()
            if not fut.done():
                t0 = time.perf_counter()
                concurrent.futures.wait([fut])
                self.wait_seconds += time.perf_counter() - t0
            fut.result()

    def flush(self) -> None:
        """Hand the buffered samples to a writer thread as one shard (waiting for a free one)."""
        if not self._pending:
            return
        batch, self._pending, self._pending_bytes = self._pending, [], 0
        name = f"shard-{self._next:05d}.safetensors"
        self._next += 1
        if self._pool is None:
            self._write_shard(name, batch)
            return
        while self._inflight and self._inflight[0].done():  # surface a failed write early
            self._inflight.popleft().result()
        self._wait(keep=self.max_inflight - 1)
        self._inflight.append(self._pool.submit(self._write_shard, name, batch))

    def _write_shard(self, name: str, batch: list[_Pending]) -> None:
        import torch

        t0 = time.perf_counter()
        offsets = [0]
        for s in batch:
            offsets.append(offsets[-1] + s.tokens)
        n = offsets[-1]
        h, w = self.hidden, self.n_aux * self.hidden
        tensors = {"offsets": (torch.int64, [len(batch) + 1], [torch.tensor(offsets, dtype=torch.int64)])}
        for key, shape in (("input_ids", [n]), ("loss_mask", [n]), ("aux_hidden", [n, w]),
                           ("last_hidden", [n, h]), ("aux_scale", [n]), ("last_scale", [n])):
            if key in batch[0].tensors:
                chunks = [s.tensors[key] for s in batch]
                tensors[key] = (chunks[0].dtype, shape, chunks)
        meta = {"format": FORMAT, "dtype": self.dtype, "hidden_size": str(h), "n_aux": str(self.n_aux),
                "sample_ids": json.dumps([s.sample_id for s in batch])}
        with atomic_path(self.dir / name) as tmp:  # a full disk: the shard's temporary file goes, the error names it
            size, digest, payload = write_safetensors(tmp, tensors, meta)
        fsync_dir(self.dir)
        rec = {"kind": "shard", "file": name, "bytes": size, "payload_bytes": payload, "sha256": digest,
               "tokens": n, "n_samples": len(batch), "at": now_iso(),
               "samples": [[s.sample_id, s.split, offsets[i], s.tokens] for i, s in enumerate(batch)]}
        self._append_progress(rec)
        with self._lock:
            self.shards.append(rec)
            self.done_ids.update(s.sample_id for s in batch)
            self._pending_ids.difference_update(s.sample_id for s in batch)
            self.stats.shards_written += 1
            self.stats.samples_written += len(batch)
            self.stats.tokens_written += n
            self.stats.write_seconds += time.perf_counter() - t0

    def abort(self) -> None:
        """After a failure: finish the shards in flight, drop the buffered samples (they redo)."""
        try:
            self._wait()
        finally:
            self._pending, self._pending_bytes = [], 0
            self._pending_ids.clear()
            if self._pool is not None:
                self._pool.shutdown(wait=True)

    # -- index and manifest ----------------------------------------------------------------

    def adopt(self, src_dir: Path, rec: dict) -> bool:
        """Take over a record of another writer's directory (a part of a data-parallel job): a shard
        is renamed to this directory's next number, then recorded in its journal (a crash between
        the two leaves a file this directory does not list, removed when it is next opened, so
        its samples are redone, never stored twice); a quarantine is recorded unless the sample
        is stored. False when the record's file is gone or cut short."""
        if rec["kind"] == "quarantine":
            if rec["sample_id"] not in self.done_ids and rec["sample_id"] not in self.quarantined:
                self._append_progress(rec)
                self.quarantined[rec["sample_id"]] = rec
            return True
        src = Path(src_dir) / rec["file"]
        if not src.exists() or src.stat().st_size != rec["bytes"]:
            return False
        name = f"shard-{self._next:05d}.safetensors"
        self._next += 1
        os.replace(src, self.dir / name)
        moved = {**rec, "file": name}
        self._append_progress(moved)
        self.shards.append(moved)
        self.done_ids.update(s[0] for s in rec["samples"])
        for sid in [s for s in self.quarantined if s in self.done_ids]:
            del self.quarantined[sid]
        return True

    def ordered_shards(self) -> list[dict]:
        """The shard records by shard number: writer threads may finish (and record) out of order."""
        return sorted(self.shards, key=lambda r: int(SHARD_RE.match(r["file"]).group(1)))

    def index_frame(self) -> pl.DataFrame:
        rows = []
        for rec in self.ordered_shards():
            for pos, (sid, split, off, length) in enumerate(rec["samples"]):
                rows.append((sid, split, rec["file"], pos, off, length, False, None))
        for sid, rec in self.quarantined.items():
            rows.append((sid, rec["split"], None, None, None, rec["length"], True, rec["reason"]))
        return pl.DataFrame(rows, schema=INDEX_SCHEMA, orient="row")

    def close(self, extra: dict | None = None) -> dict:
        """Write the last shard, then the index and the manifest (atomically); returns the manifest."""
        try:
            self.flush()
            self._wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
        write_parquet_atomic(self.index_frame(), self.dir / INDEX)
        manifest = self.manifest(extra)
        with atomic_path(self.dir / MANIFEST) as tmp:
            tmp.write_text(json.dumps(manifest, indent=2))
        return manifest

    def manifest(self, extra: dict | None = None) -> dict:
        tokens = sum(r["tokens"] for r in self.shards)
        size = sum(r["bytes"] for r in self.shards)
        payload = sum(r["payload_bytes"] for r in self.shards)
        storage = {"input_ids": "int32", "loss_mask": "int8", "offsets": "int64"}
        if self.dtype == "bf16":
            storage.update(aux_hidden="bfloat16", last_hidden="bfloat16")
        else:
            storage.update(aux_hidden="float8_e4m3fn", last_hidden="float8_e4m3fn",
                           aux_scale="float32", last_scale="float32")
        return {
            "format": FORMAT,
            **{k: v for k, v in self.meta.items()},
            "dtype": self.dtype,
            "storage_dtypes": storage,
            "fp8_scale": "per token: scale = amax / 448, value = q * scale" if self.dtype == "fp8" else None,
            "hidden_size": self.hidden,
            "n_aux": self.n_aux,
            "aux_width": self.n_aux * self.hidden,
            "num_samples": sum(r["n_samples"] for r in self.shards),
            "num_tokens": tokens,
            "num_quarantined": len(self.quarantined),
            "quarantined": [{"sample_id": s, "split": r["split"], "length": r["length"], "reason": r["reason"]}
                            for s, r in sorted(self.quarantined.items())],
            "bytes": size,
            "payload_bytes": payload,
            "bytes_per_token": size / tokens if tokens else None,
            "shards": [{k: r[k] for k in ("file", "bytes", "payload_bytes", "sha256", "tokens", "n_samples")}
                       for r in self.ordered_shards()],
            "index": INDEX,
            "created_at": self._settings.get("created_at"),
            "updated_at": now_iso(),
            **(extra or {}),
        }
