"""A producer: captures the spool's units with one of the project's extraction backends.

    python -m eagle3_assets.hidden_states.spool --config producer.json

Loop: under the spool's lock, give dead producers' units back, delete consumed units, then take
the unit the trainer will read first among those neither published, consumed nor leased, if
the spool's bytes (outside temporary folders) plus every live lease's reservation plus this
unit's bound stay within the cap, and the producer is not paused by the watermarks (above the
high mark, reservations counted, it waits until the spool is below the low mark; the unit the
trainer waits on is started anyway). Capture runs ``extract_corpus`` on
the unit's rows into its temporary folder (so the writer's checks hold: a sample whose states
are not finite is quarantined there and never trained on), then, under the lock, the folder
is renamed into ``units/`` unless the unit was consumed meanwhile, and the lease is dropped.

When the unit the trainer needs next cannot fit because later units fill the spool (after a
crash put it back in the pool), the latest of those are deleted to make room (they are
captured again): the trainer never waits forever on a full spool.

A disk that fills anyway (another process's files: the cap was checked against the free space
when the plan was written) is fatal, not retried: the unit goes back to the pool, the producer
records why in ``failed.json`` (the trainer stops at once with that message, naming the path)
and ends.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Literal

from pydantic import Field

from eagle3_assets.engines import engine_names
from eagle3_assets.files import disk_full_names, is_disk_full, require_free
from eagle3_assets.hidden_states.extract_job import VLLMServerSpec
from eagle3_assets.hidden_states.journal import now_iso
from eagle3_assets.hidden_states.spool.plan import PLAN, Plan, load_plan
from eagle3_assets.hidden_states.spool.store import Heartbeat, Spool
from eagle3_assets.job_file import JobFile
from eagle3_assets.target.ref import TargetRef

CAPTURES = "captures.jsonl"  # one line per published unit: which producer captured which samples


class ProducerJob(JobFile):
    """One producer process; the capture backend's fields are those of ``ExtractionJob``."""

    spool_dir: str
    corpora: dict[str, str] = {}  # corpus path as the plan names it -> where this node reads it (default: same)
    backend: Literal[engine_names("extract")] = "local"  # any extract engine; a tensor_parallel one (sglang) in one rank
    target: TargetRef
    device: str = "auto"
    model_dtype: str = "auto"
    threads: int = Field(0, ge=0)
    vllm: VLLMServerSpec | None = None
    tp_size: int = Field(1, ge=1)  # a tensor_parallel engine's: one rank per producer (more are refused)
    max_rows: int = Field(256, ge=1)  # a tensor_parallel engine's requests per forward
    server_args: dict = Field(default_factory=dict)  # a tensor_parallel engine's further settings (SGLang ServerArgs)
    name: str = ""  # shown in leases and the captures journal (default: host:pid)
    run: str = ""  # the run that started this producer (the step's), on each of its lines of the captures journal
    poll_s: float = Field(0.05, gt=0.0)
    heartbeat_s: float = Field(2.0, gt=0.0)
    stale_s: float = Field(60.0, gt=0.0)  # a lease of another host with an older heartbeat is dead
    plan_timeout_s: float = Field(3600.0, gt=0.0)  # how long to wait for the trainer to write the plan


class Producer:
    def __init__(self, job: ProducerJob, extractor, plan: Plan):
        self.job, self.extractor, self.plan = job, extractor, plan
        self.spool = Spool(job.spool_dir, stale_s=job.stale_s)
        self.name = job.name or f"{self.spool.host}:{os.getpid()}"
        self.paused = False
        self.stats = {"units": 0, "samples": 0, "tokens": 0, "capture_s": 0.0, "wait_s": 0.0, "dropped": 0,
                      "evicted": 0, "reclaimed": 0}
        self._corpus: dict[int, object] = {}

    def corpus(self, d: int):
        import polars as pl

        if d not in self._corpus:
            name = self.plan.corpora[d]
            self._corpus[d] = pl.read_parquet(self.job.corpora.get(name, name),
                                              columns=["sample_id", "split", "input_ids", "loss_mask"])
        return self._corpus[d]

    def choose(self):
        """Under the lock: the lease of the unit to capture now, or None (nothing fits, paused, all done)."""
        s, plan = self.spool, self.plan
        self.stats["reclaimed"] += len(s.reclaim())
        cursor = s.cursor()
        s.sweep(plan, cursor)
        held = s.used()  # the watermarks, like the cap, count what live leases have reserved
        cap = plan.cap_bytes
        if self.paused and held < plan.data["low_water"] * cap:
            self.paused = False
        elif not self.paused and held > plan.data["high_water"] * cap:
            self.paused = True
        published, leases = s.published(), s.leases()
        open_units = sorted((u for u in plan.units if u.last_use >= cursor and u.id not in published),
                            key=lambda u: u.first_use)
        todo = [u for u in open_units if u.id not in leases]
        if not todo:
            return None
        unit = todo[0]
        needed_next = unit is open_units[0]  # the trainer waits on it, and nobody captures it
        if self.paused and not needed_next:
            return None
        if s.used() + unit.bytes > cap and needed_next:
            later = sorted((plan.by_id[u] for u in published if u in plan.by_id and plan.by_id[u].first_use > unit.first_use),
                           key=lambda u: -u.first_use)
            for victim in later:
                if s.used() + unit.bytes <= cap:
                    break
                s.remove_unit(victim.id)
                self.stats["evicted"] += 1
        if s.used() + unit.bytes > cap:
            return None
        lease = s.take(unit.id, unit.bytes, self.name)
        return (unit, lease) if lease else None

    def capture(self, unit, lease) -> bool:
        """Capture ``unit`` into the lease's temporary folder, then publish it; False if it was dropped."""
        import polars as pl

        from eagle3_assets.hidden_states.extract import extract_corpus

        tmp = self.spool.tmp_dir / lease["tmp"]
        # the unit's bound, which the cap counted: short only when something besides the spool filled the disk
        require_free(tmp, unit.bytes, f"unit {unit.id} of the stream's spool")
        rows = self.corpus(unit.dataset).filter(pl.col("sample_id").is_in(unit.samples))
        order = {s: i for i, s in enumerate(unit.samples)}
        rows = rows.sort(pl.col("sample_id").replace_strict(order, return_dtype=pl.Int64))
        corpus = tmp / "unit-corpus.parquet"
        with disk_full_names(corpus):
            rows.write_parquet(corpus)
        t0 = time.perf_counter()
        report = extract_corpus(corpus, tmp, self.extractor, dtype=self.plan.data["dtype"], shard_bytes=1 << 40,
                                batch_tokens=self.plan.data["batch_tokens"], background_writes=False, disk_margin=None)
        self.stats["capture_s"] += time.perf_counter() - t0
        size = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
        if size > unit.bytes:  # the bound the cap was checked with did not hold: a bug, never silently over the cap
            raise RuntimeError(f"unit {unit.id}: {size:,} bytes captured, above its bound of {unit.bytes:,}")
        with self.spool.lock():
            if not self.spool.owns(lease) or unit.last_use < self.spool.cursor():
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
                self.spool.drop(lease) if self.spool.owns(lease) else None
                self.stats["dropped"] += 1
                return False
            os.replace(tmp, self.spool.unit_dir(unit.id))
            self.spool.drop(lease)
            with disk_full_names(self.spool.root / CAPTURES), open(self.spool.root / CAPTURES, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"unit": unit.id, "producer": self.name, "run": self.job.run, "samples": unit.samples,
                                     "quarantined": report.quarantined_total, "bytes": size, "at": now_iso()}) + "\n")
        self.stats["units"] += 1
        self.stats["samples"] += len(unit.samples)
        self.stats["tokens"] += report.tokens_extracted
        return True

    def give_back(self, lease) -> None:
        import shutil

        with self.spool.lock():
            if self.spool.owns(lease):
                shutil.rmtree(self.spool.tmp_dir / lease["tmp"], ignore_errors=True)
                self.spool.drop(lease)

    def run(self, stop_when_idle: bool = False) -> dict:
        """Capture until the run is done (``done.json``), or, with ``stop_when_idle``, nothing is left to take."""
        beat = Heartbeat(self.job.heartbeat_s)
        t_start = time.perf_counter()
        try:
            self._loop(beat, stop_when_idle)
        except Exception as exc:
            if is_disk_full(exc):  # not retried: the trainer stops now, with the path, rather than wait on this unit
                self.spool.mark_failed(f"producer {self.name}", str(exc))
            raise
        finally:
            beat.stop()
        self.stats["seconds"] = time.perf_counter() - t_start
        return self.stats

    def _loop(self, beat: Heartbeat, stop_when_idle: bool) -> None:
        """Take, capture and publish units until the run is done (or, ``stop_when_idle``, nothing is left)."""
        while self.spool.done() is None:
            with self.spool.lock():
                picked = self.choose()
            if picked is None:
                if stop_when_idle and self.spool.cursor() >= self.plan.total_positions:
                    break
                t0 = time.perf_counter()
                time.sleep(self.job.poll_s)
                self.stats["wait_s"] += time.perf_counter() - t0
                continue
            unit, lease = picked
            beat.paths.add(lease["path"])
            try:
                self.capture(unit, lease)
            except BaseException:
                self.give_back(lease)  # the unit goes back to the pool now, not when a lease check finds us dead
                raise
            finally:
                beat.paths.discard(lease["path"])


def wait_for_plan(spool_dir: Path, timeout_s: float) -> Plan:
    deadline = time.monotonic() + timeout_s
    while not (Path(spool_dir) / PLAN).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{spool_dir}: no {PLAN} after {timeout_s:.0f} s: is the trainer running?")
        time.sleep(0.2)
    return load_plan(spool_dir)


def build_producer_extractor(job: ProducerJob, plan: Plan, stack: ExitStack):
    """The capture backend through the extraction job's own seam, with the plan's layers; a
    ``tensor_parallel`` engine's capture through its role, in a one-rank group."""
    from eagle3_assets.engines import engine_role
    from eagle3_assets.hidden_states.extract_job import ExtractionJob, build_extractor

    role = engine_role("extract", job.backend)
    if role.tensor_parallel:
        return one_rank_extractor(job, role, plan, stack)
    ejob = ExtractionJob(backend=job.backend, target=job.target, corpus="-", out_dir="-",
                         layer_ids=plan.data["layer_ids"], device=job.device, model_dtype=job.model_dtype,
                         dtype=plan.data["dtype"], threads=job.threads, vllm=job.vllm)
    return build_extractor(ejob, stack)


def one_rank_extractor(job: ProducerJob, role, plan: Plan, stack: ExitStack):
    """The engine's capture (``role.capture``, as each rank of ``sglang_extract`` builds it) in this
    process alone, wrapped as ``extract_corpus`` expects (``LeaderExtractor``): its KV pool is sized
    for the plan's longest row, and the forwards are batched within the plan's ``batch_tokens``."""
    from eagle3_assets.hidden_states.sglang_extract import SGLangExtractionJob, describe
    from eagle3_assets.hidden_states.tensor_parallel import LeaderExtractor, init_tensor_parallel
    from eagle3_assets.target import layers as hidden_layers

    if job.tp_size != 1:
        raise ValueError(f"producer job: tp_size {job.tp_size} for backend {job.backend!r}: a producer runs its "
                         f"capture in one process (tp_size: 1); several ranks per producer are not supported")
    sjob = SGLangExtractionJob(engine=job.backend, target=job.target, corpus="-", out_dir="-", tp_size=1,
                               layer_ids=plan.data["layer_ids"], dtype=plan.data["dtype"],
                               batch_tokens=plan.data["batch_tokens"], max_rows=job.max_rows,
                               model_dtype=job.model_dtype, server_args=job.server_args)
    group = init_tensor_parallel(1)
    target = job.target.open()
    layer_ids = hidden_layers.resolve_layer_ids(target.num_layers, sjob.layer_ids)
    longest = max((n for lengths in plan.data["lengths"] for n in lengths.values()), default=1)
    capture = role.capture(sjob, group, layer_ids, longest_row=int(longest))
    leader = LeaderExtractor(capture, group, hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                             max_rows=job.max_rows, page_size=getattr(capture, "page_size", 1),
                             describe=describe(sjob, target, layer_ids, role.label()))
    stack.callback(leader.stop)
    return leader


def run_producer(job: ProducerJob, stop_when_idle: bool = False) -> dict:
    if job.threads:
        import torch

        torch.set_num_threads(job.threads)
    plan = wait_for_plan(Path(job.spool_dir), job.plan_timeout_s)
    if Spool(job.spool_dir, stale_s=job.stale_s).done() is not None:  # started after the run ended (a late
        stats = Producer(job, None, plan).run()  # replacement): nothing to capture, no engine to load
    else:
        with ExitStack() as stack:
            extractor = build_producer_extractor(job, plan, stack)
            if int(extractor.hidden_size) != plan.data["hidden_size"]:
                raise ValueError(f"{job.target.model_dir}: hidden size {extractor.hidden_size}, "
                                 f"the plan's is {plan.data['hidden_size']}")
            stats = Producer(job, extractor, plan).run(stop_when_idle=stop_when_idle)
    print(f"eagle3: producer done: {json.dumps(stats)}", file=sys.stderr, flush=True)
    return stats
