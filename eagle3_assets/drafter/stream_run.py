"""The streaming mode of ``drafter_checkpoint``: the recipe's producers and trainer from one step.

``StreamRun`` writes one ``ProducerJob`` per producer (its engine's settings from
``stream_jobs``), starts each producer (``python -m eagle3_assets.hidden_states.spool``) as a ``Launch``
through the step's launcher's ``start`` (a process of this machine, or a SLURM job of its own on
another node), beside the trainer the step then launches with ``run``; it samples the spool's
bytes from the filesystem while it trains, logs the trainer's preflight and both sides' progress,
and afterwards reports what each side did in this run (the captures journal's lines carry the
run's id, so a relaunch after a kill does not add the earlier runs' units to this one's timings):
units and tokens captured, the spool's peak bytes against its cap, the trainer's and the producers'
waiting time. The producers end when the trainer marks the run done; a failed training stops them.
A producer that fails is started again, up to ``producer_restarts`` times in all, unless it recorded
in the spool that the run cannot go on (a full disk); when none is started again the spool records
that too, and the trainer stops at once with the reason.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path

from eagle3_assets.drafter.stream_jobs import producer_settings
from eagle3_assets.hidden_states.spool.plan import PLAN
from eagle3_assets.hidden_states.spool.preflight import PREFLIGHT, preflight_line
from eagle3_assets.hidden_states.spool.produce import CAPTURES, ProducerJob
from eagle3_assets.hidden_states.spool.settings import StreamSettings
from eagle3_assets.hidden_states.spool.store import CURSOR, DONE, Spool, tree_bytes
from eagle3_assets.launchers import Launch, forwarded_env, wait_all
from eagle3_assets.paths import REPO_ROOT
from eagle3_assets.target.ref import TargetRef


def _read_json(path: Path) -> dict | None:
    """A JSON file the other side writes atomically; None while it is not there yet."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class StreamRun:
    """Producers started on enter, stopped (or awaited) on exit; ``figures()`` for the metadata."""

    def __init__(self, context, settings: StreamSettings, target, out: Path, launcher, name: str, stream,
                 resources, check_s: float = 2.0):
        """``stream``: the step's ``StreamingConfig``; ``resources``: the step's (those the capture
        engine's extract role reads)."""
        self.context, self.settings, self.out, self.n = context, settings, Path(out) / "stream", stream.producers
        self.launcher, self.name = launcher, name  # the producers' launcher; their jobs' name prefix
        self.spool = Path(settings.spool_dir)
        self.run_id = getattr(context, "run_id", None) or uuid.uuid4().hex  # on this run's lines of the captures journal
        self.gave_up = False  # no producer is started again: the spool says why (failed.json)
        self.python = stream.python
        spec = target.spec()
        self.job = dict(spool_dir=settings.spool_dir, target=TargetRef.of(spec), stale_s=stream.stale_s,
                        device=target.device, model_dtype=target.dtype, threads=getattr(target, "threads", 0) or 0,
                        backend=stream.backend,
                        **producer_settings(stream, target, resources, settings.corpora, spec))
        restarts = stream.producer_restarts
        self.started: list = []  # the live handle of each producer
        self.ended: list = []  # handles of producers that failed and were started again
        self.launches: list[Launch] = []
        self.restarts, self.check_s, self.progress_s, self.relaunched = restarts, check_s, stream.progress_every_s, 0
        self.peak = 0
        self._planned: tuple[int, int] | None = None  # the plan's units and steps, once the trainer wrote it
        self.preflight: dict | None = None  # the trainer's preflight figures, once written
        self._journal = (0, 0)  # the captures journal: bytes read, lines counted
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._closing = False

    def _sample(self) -> None:
        """The spool's bytes every 50 ms; every ``check_s`` the producers' state; every
        ``progress_s`` one line of both sides' progress in the step's log."""
        next_check = time.monotonic() + self.check_s
        next_progress = time.monotonic() + self.progress_s
        held = 0
        while not self._stop.wait(0.05):
            if self.spool.exists():
                held = tree_bytes(self.spool)
                self.peak = max(self.peak, held)
            if self.preflight is None and (preflight := _read_json(self.spool / PREFLIGHT)):
                self.preflight = preflight
                self.context.log.info(f"streaming: {preflight_line(self.preflight).removeprefix('eagle3: ')}")
            if time.monotonic() >= next_progress:
                next_progress = time.monotonic() + self.progress_s
                self.context.log.info(f"streaming: {self.progress(held)}")
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + self.check_s
                try:
                    self._relaunch_failed()
                except Exception as exc:  # a scheduler hiccup (squeue down): try again at the next check
                    self.context.log.warning(f"streaming: could not check the producers: {exc}")

    def progress(self, held: int) -> str:
        """Capture and training so far, from the spool's own files: units published (captures journal)
        of those planned, the trainer's step (cursor) of the plan's, the spool's bytes against the cap."""
        if self._planned is None and (plan := _read_json(self.spool / PLAN)):  # written once: read once
            self._planned = (len(plan["units"]), plan["total_steps"])
        units, steps = self._planned or ("?", "?")
        cursor = _read_json(self.spool / CURSOR) or {}
        published = self._count_captures()
        alive = sum(s.poll() is None for s in self.started)
        return (f"capture {published} of {units} units; training step {cursor.get('step') or 0} "
                f"of {steps}; spool {held:,} of {self.settings.cap_bytes:,} bytes "
                f"(peak {self.peak:,}); {alive} of {self.n} producer(s) running")

    def _count_captures(self) -> int:
        """Units this run published so far: its lines of the captures journal, read on from where the
        last count stopped (at K2.5's scale the journal grows to tens of MB over a run)."""
        path = self.spool / CAPTURES
        if path.exists():
            with open(path, "rb") as fh:
                fh.seek(self._journal[0])
                chunk = fh.read()
            whole = chunk[: chunk.rfind(b"\n") + 1]  # a line being appended is counted next time
            ours = f'"run": {json.dumps(self.run_id)}'.encode()
            mine = sum(ours in line for line in whole.splitlines())
            self._journal = (self._journal[0] + len(whole), self._journal[1] + mine)
        return self._journal[1]

    def _relaunch_failed(self) -> None:
        with self._lock:
            if self.gave_up:
                return
            for i, started in enumerate(self.started):
                if self._closing or (self.spool / DONE).exists():
                    return
                code = started.poll()
                if code in (None, 0):
                    continue
                failed = Spool(self.spool).failed()
                if failed is not None:  # a full disk: no restart helps; the trainer stops on this record
                    self._give_up(f"producer {i} ended with {code}: {failed.get('error')} (output: {started.log})")
                    return
                if self.relaunched >= self.restarts:
                    Spool(self.spool).mark_failed("the streaming step", f"producer {i} ended with {code} and its "
                                                  f"{self.restarts} restart(s) are spent (output: {started.log})")
                    self._give_up(f"producer {i} ended with {code}; {self.restarts} restart(s) spent, not starting it "
                                  f"again (output: {started.log})")
                    return
                self.relaunched += 1
                self.context.log.warning(f"streaming: producer {i} ended with {code} before the run was done "
                                         f"(output: {started.log}); starting it again ({self.relaunched} of at most "
                                         f"{self.restarts})")
                self.ended.append(started)
                self.started[i] = self.launcher.start(self.context, self.launches[i], self.out / f"producer-{i}")

    def _give_up(self, why: str) -> None:
        """Logged once; the trainer stops at its next wait, reading the spool's failed.json."""
        self.gave_up = True
        self.context.log.error(f"streaming: {why}; the trainer stops")

    def __enter__(self):
        self.out.mkdir(parents=True, exist_ok=True)
        self.spool.mkdir(parents=True, exist_ok=True)
        # an earlier run's preflight (the trainer writes this run's) and failure (this run starts afresh)
        (self.spool / PREFLIGHT).unlink(missing_ok=True)
        Spool(self.spool).clear_failed()
        exports = {**forwarded_env(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        if self.python:  # another environment's interpreter: the project from this checkout
            exports["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
        try:
            for i in range(self.n):
                path = self.out / f"producer-{i}.json"
                path.write_text(ProducerJob(**self.job, name=f"producer-{i}", run=self.run_id).model_dump_json(indent=2))
                launch = Launch(f"{self.name}-{i}", "eagle3_assets.hidden_states.spool", ["--config", str(path)],
                                exports=exports, python=self.python)
                self.launches.append(launch)
                self.started.append(self.launcher.start(self.context, launch, self.out / f"producer-{i}"))
        except BaseException:
            self._stop_all(0.0)
            raise
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self.context.log.info(f"streaming: {self.n} {self.job['backend']} producer(s) started on {self.spool} "
                              f"(cap {self.settings.cap_bytes:,} bytes)")
        return self

    def _stop_all(self, wait_s: float) -> None:
        """Producers still queued stop at once (one would only start to find the run over); the
        others get ``wait_s`` to end by themselves, then are stopped."""
        for s in self.started:
            if s.queued():
                self.context.log.info(f"streaming: a producer still queued at the end, stopped ({s.log.name} never written)")
                s.stop()
        if not wait_all(self.started, wait_s):
            self.context.log.warning(f"streaming: stopping {sum(s.poll() is None for s in self.started)} producer(s)")
        for s in self.started:
            if s.poll() is None:
                s.stop()

    def __exit__(self, exc_type, *_):
        with self._lock:
            self._closing = True  # no producer started again from here on
        try:
            self._stop_all(5 if exc_type else 120)  # after a done run they end by themselves
        finally:
            self._stop.set()
            self._thread.join()
        return False

    def figures(self, result: dict) -> dict:
        captures = []  # this run's: the journal holds the earlier runs' of the same plan too
        if (self.spool / CAPTURES).exists():
            captures = [c for x in (self.spool / CAPTURES).read_text().splitlines() if x.strip()
                        if (c := json.loads(x)).get("run") == self.run_id]
        stats = []
        for started in [*self.ended, *self.started]:
            log = started.log.read_text() if started.log.exists() else ""
            if "producer done: " in log:
                stats.append(json.loads(log[log.rindex("producer done: ") + 15:].splitlines()[0]))
        stream = result.get("stream") or {}
        wall = result.get("wall_s") or 0.0
        return {
            "stream_backend": self.job["backend"],
            "stream_producers": self.n,
            "stream_cap_bytes": self.settings.cap_bytes,
            "stream_peak_spool_bytes": self.peak,
            "stream_units_planned": stream.get("units"),
            "stream_units_captured": len(captures),
            "stream_samples_captured": sum(len(c["samples"]) for c in captures),
            "stream_trainer_wait_s": stream.get("wait_s"),
            "stream_trainer_wait_share": round(stream["wait_s"] / wall, 3) if wall and "wait_s" in stream else None,
            "stream_producer_wait_s": round(sum(s["wait_s"] for s in stats), 3),
            "stream_producer_wait_share": round(sum(s["wait_s"] for s in stats) / max(1e-9, sum(s["seconds"] for s in stats)), 3)
            if stats else None,
            "stream_producer_capture_s": round(sum(s["capture_s"] for s in stats), 3),
            # one producer's capture rate while capturing: the next run's preflight reads it
            "stream_capture_tokens_per_s": round(sum(s["tokens"] for s in stats) / sum(s["capture_s"] for s in stats), 1)
            if stats and sum(s["capture_s"] for s in stats) > 0 else None,
            **{f"stream_preflight_{k}": v for k, v in (self.preflight or {}).items()
               if k in ("offline_bytes", "min_cap_bytes", "trainer_idle_share")},
            "stream_producer_restarts": self.relaunched,
            "stream_units_recaptured": stream.get("units_recaptured"),  # failed their read-back: captured again
            "stream_trainer_verify_s": stream.get("verify_s"),
        }
