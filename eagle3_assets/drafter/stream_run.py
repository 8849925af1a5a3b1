"""The streaming mode of ``drafter_checkpoint``: the recipe's producers and trainer from one step.

``StreamRun`` writes the spool's settings for the training job and one ``ProducerJob`` per
producer, starts each producer (``python -m eagle3_assets.hidden_states.spool``) as a ``Launch``
through the step's launcher's ``start`` (a process of this machine, or a SLURM job of its own on
another node), beside the trainer the step then launches with ``run``; it samples the spool's
bytes from the filesystem while it trains, and afterwards reports what each side did: units and
tokens captured, the spool's peak bytes against its cap, the trainer's and the producers' waiting
time. The producers end when the trainer marks the run done; a failed training stops them.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from eagle3_assets.engines import engine_role
from eagle3_assets.hidden_states.spool.produce import CAPTURES, ProducerJob
from eagle3_assets.hidden_states.spool.settings import StreamSettings
from eagle3_assets.hidden_states.spool.store import DONE, tree_bytes
from eagle3_assets.launchers import Launch, forwarded_env, wait_all
from eagle3_assets.paths import REPO_ROOT
from eagle3_assets.target.ref import TargetRef


def stream_settings_for(layout, recipe, stream) -> StreamSettings:
    """The training job's spool settings from the step's ``StreamingConfig``."""
    return StreamSettings(spool_dir=str(layout.root / "spool" / recipe.name),
                          corpora={str(layout.corpus(d)): float(w) for d, w in recipe.datasets.items()},
                          cap_bytes=stream.cap_bytes, unit_bytes=stream.unit_bytes,
                          epochs=stream.epochs, layer_ids=recipe.shape.aux_layer_ids)


def longest_corpus(corpora) -> str:
    """The corpus holding the longest row: an engine sizes its server or KV pool by it."""
    import polars as pl

    def longest(path):
        return pl.scan_parquet(path).select(pl.col("input_ids").list.len().max()).collect().item() or 0

    return max(corpora, key=longest)


def producer_settings(stream, target, resources, corpora, spec) -> dict:
    """The ``ProducerJob`` fields of the configured capture engine, through its extract role: a
    ``tensor_parallel`` engine's capture runs as one rank in each producer (``tp_size`` 1) with the
    further ``sglang_server_args``; the others' job settings are their extraction job's, sized for
    the recipe's longest row (vLLM's: the server each producer starts)."""
    from types import SimpleNamespace

    role = engine_role("extract", stream.backend)
    if role.tensor_parallel:
        if stream.tp_size != 1:
            raise ValueError(f"stream.tp_size {stream.tp_size} for backend {stream.backend!r}: each producer "
                             "captures as one rank (tp_size: 1); for more capture, raise stream.producers")
        return {"server_args": dict(stream.sglang_server_args), "tp_size": 1}
    shape = SimpleNamespace(tp_size=stream.tp_size, vllm_server_args=list(stream.vllm_server_args))
    return role.job_settings(shape, target, resources, longest_corpus(corpora), spec)


def corpus_train_sizes(layout, datasets) -> dict[str, int]:
    """Training samples per dataset from the corpus (streaming needs no hidden states beforehand)."""
    import polars as pl

    return {d: pl.scan_parquet(layout.corpus(d)).filter(pl.col("split") == "train").select(pl.len()).collect().item()
            for d in datasets}


class StreamRun:
    """Producers started on enter, stopped (or awaited) on exit; ``figures()`` for the metadata."""

    def __init__(self, context, settings: StreamSettings, target, out: Path, launcher, name: str, stream,
                 resources, check_s: float = 2.0):
        """``stream``: the step's ``StreamingConfig``; ``resources``: the step's (those the capture
        engine's extract role reads)."""
        self.context, self.settings, self.out, self.n = context, settings, Path(out) / "stream", stream.producers
        self.launcher, self.name = launcher, name  # the producers' launcher; their jobs' name prefix
        self.spool = Path(settings.spool_dir)
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
        self.restarts, self.check_s, self.relaunched = restarts, check_s, 0
        self.peak = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._closing = False

    def _sample(self) -> None:
        """The spool's bytes every 50 ms; every ``check_s`` the producers' state."""
        next_check = time.monotonic() + self.check_s
        while not self._stop.wait(0.05):
            if self.spool.exists():
                self.peak = max(self.peak, tree_bytes(self.spool))
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + self.check_s
                try:
                    self._relaunch_failed()
                except Exception as exc:  # a scheduler hiccup (squeue down): try again at the next check
                    self.context.log.warning(f"streaming: could not check the producers: {exc}")

    def _relaunch_failed(self) -> None:
        with self._lock:
            for i, started in enumerate(self.started):
                if self._closing or (self.spool / DONE).exists():
                    return
                code = started.poll()
                if code in (None, 0):
                    continue
                if self.relaunched >= self.restarts:
                    self.context.log.error(f"streaming: producer {i} ended with {code}; {self.restarts} restart(s) "
                                           "spent, not starting it again (the trainer waits for its units)")
                    continue
                self.relaunched += 1
                self.context.log.warning(f"streaming: producer {i} ended with {code} before the run was done "
                                         f"(output: {started.log}); starting it again ({self.relaunched} of at most "
                                         f"{self.restarts})")
                self.ended.append(started)
                self.started[i] = self.launcher.start(self.context, self.launches[i], self.out / f"producer-{i}")

    def __enter__(self):
        self.out.mkdir(parents=True, exist_ok=True)
        self.spool.mkdir(parents=True, exist_ok=True)
        exports = {**forwarded_env(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        if self.python:  # another environment's interpreter: the project from this checkout
            exports["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
        try:
            for i in range(self.n):
                path = self.out / f"producer-{i}.json"
                path.write_text(ProducerJob(**self.job, name=f"producer-{i}").model_dump_json(indent=2))
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
        captures = []
        if (self.spool / CAPTURES).exists():
            captures = [json.loads(x) for x in (self.spool / CAPTURES).read_text().splitlines() if x.strip()]
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
            "stream_producer_restarts": self.relaunched,
        }
