"""Generation at scale over HTTP: one async engine under the SGLang and OpenRouter backends.

``run_datasets`` runs many datasets through one in-flight gate (each with its own budget, files,
resume and report); ``run_generation`` is the one-dataset form. Resumable by sample id across every
source on disk, so a dataset can be started on one backend and finished on another.

The parts live in their own modules: below the stage, the backends' wire, reply classification and
the client's settings (``engines/http/``); here the run's settings (:mod:`http_config`), reports
and progress (:mod:`http_report`), the pre-run plan (:mod:`plan`), budget admission
(:mod:`admission`), one dataset's state in a run (:mod:`lanes`), the client shards (:mod:`clients`)
and the run loop (:mod:`http_run`). This module puts them together and keeps the names callers import.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable

from eagle3_assets.engines.http.classify import Outcome, classify, classify_exception, parse_retry_after
from eagle3_assets.engines.http.client import ClientConfig, Prices
from eagle3_assets.engines.http.samples import SampleRequest, SamplingSettings
from eagle3_assets.engines.http.wire import BackendUnavailable
from eagle3_assets.generation.admission import POLICIES, AdmissionPolicy
from eagle3_assets.generation.budget import TokenBudget
from eagle3_assets.generation.clients import ClientShards
from eagle3_assets.generation.http_config import EngineSettings, RetryPolicy
from eagle3_assets.generation.http_report import (
    HttpGenerationReport,
    Progress,
    RunStopped,
    raise_for_stop,
)
from eagle3_assets.generation.http_run import EngineRun
from eagle3_assets.generation.key_ledger import KeyLedger
from eagle3_assets.generation.lanes import DatasetJob, Lane
from eagle3_assets.generation.plan import DatasetState, RunPlan, plan_remaining
from eagle3_assets.generation.response_store import ResponseStore

__all__ = [
    "POLICIES", "AdmissionPolicy", "BackendUnavailable", "ClientConfig", "DatasetJob", "DatasetState",
    "EngineSettings", "HttpGenerationReport", "Outcome", "Prices", "Progress", "RetryPolicy", "RunPlan",
    "RunStopped", "classify", "classify_exception", "generate_http", "parse_retry_after", "plan_remaining",
    "raise_for_stop", "run_datasets", "run_generation",
]


async def run_datasets(jobs: list[DatasetJob], backend, *, sampling: SamplingSettings, settings: EngineSettings,
                       stop_event=None, progress: Callable[[Progress], None] | None = None) -> HttpGenerationReport:
    """Generate every job's samples through one gate of ``settings.concurrency`` requests in flight.

    Returns the run's report; ``lanes`` maps each dataset to its own. A run stopped by 401/credits
    returns normally with ``stopped_reason`` set (:func:`raise_for_stop` turns that into an
    exception). Raises :class:`BackendUnavailable` when the pre-run health check fails.
    """
    lanes = [Lane(job, backend.source, settings.max_tokens, settings.concurrency) for job in jobs]
    total = sum(len(lane.pending) for lane in lanes)
    workers = max(1, min(settings.concurrency, total))
    run = EngineRun(backend, lanes, settings, sampling, workers=workers, stop_event=stop_event, progress=progress)
    report = run.report
    shards = ClientShards(backend, workers, settings.client)
    report.clients = len(shards.clients)
    tasks: list[asyncio.Task] = []
    started = False
    try:
        if not total:  # nothing to buy: no health check, no request
            return report
        if settings.preflight:
            info, stop = await backend.preflight(shards.clients[0], shards.urls)
            report.backend_info.update(info)
            if stop is not None:
                run.stop(stop.reason, stop.message)
                return report
        if settings.bar:
            run.open_bar(total, lanes[0].dataset if len(lanes) == 1 else f"{len(lanes)} datasets")
        started = True
        run.meter.t0 = run.meter._t = time.monotonic()
        for lane in lanes:
            lane.open()
        run.key_ledger = _open_key_ledger(backend, lanes, report)
        try:
            aux = [asyncio.create_task(run.syncer()), asyncio.create_task(run.loop_lag.run())]
            if progress is not None:
                aux.append(asyncio.create_task(run.ticker()))
            if stop_event is not None:
                aux.append(asyncio.create_task(run.watch_external_stop()))
            tasks = [asyncio.create_task(run.worker(w, shards)) for w in range(workers)]
            for t in tasks:
                t.add_done_callback(run.on_worker_done)
            stopping = asyncio.create_task(run.stopping.wait())
            try:
                all_done = asyncio.ensure_future(asyncio.wait(tasks))
                await asyncio.wait({all_done, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if not all_done.done():  # stopping: let in-flight requests end within the bound
                    await asyncio.wait({all_done}, timeout=settings.drain_timeout_s)
            finally:
                # also reached when this coroutine is cancelled (Ctrl-C, a Dagster interrupt):
                # cancel what is left; every kept row is already in its file
                for t in tasks:
                    if not t.done():
                        t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                stopping.cancel()
                for t in aux:
                    t.cancel()
                await asyncio.gather(*aux, return_exceptions=True)
            failures = [t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception()]
            if failures:
                raise failures[0]
            if run.write_error is not None:
                raise RuntimeError(backend.redact(f"writing {backend.source} rows failed: {run.write_error}")) from None
            if settings.preflight and report.stopped_reason != "unauthorized":
                info = {}
                try:
                    info = await backend.postflight(shards.clients[0], shards.urls)
                    report.backend_info.update(info)
                    run.apportion_unseen(info.get("key_usage_delta"))
                except Exception:  # noqa: BLE001 - reconciliation is best effort; the next run does it
                    pass
                if run.key_ledger is not None:
                    run.key_ledger.close(info.get("key_usage_after"), {
                        lane.dataset: {"run_seen_usd": math.fsum([*lane.costs, *lane.failed_costs]),
                                       "run_unseen_usd": lane.report.billed_unseen_usd,
                                       "attempts": lane.report.attempts} for lane in lanes})
        finally:
            for lane in lanes:
                lane.close()  # fsync and close every file
        return report
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await shards.aclose()
        if run.bar is not None:
            run.bar.close()
        _finish(run, started)
        if progress is not None and started:
            try:
                final = run.snapshot()
                final.finished = True
                progress(final)
            except Exception:  # noqa: BLE001
                pass


def _open_key_ledger(backend, lanes: list[Lane], report: HttpGenerationReport) -> KeyLedger | None:
    """Record the key's usage before the run with each dataset's files, after reconciling the runs
    that died on them (their share goes to ``billed_to_dead_runs_usd``)."""
    usage = report.backend_info.get("key_usage_before")
    key = getattr(backend, "key_id", None)
    if usage is None or key is None:
        return None
    ledger = KeyLedger({lane.dataset: lane.job.store for lane in lanes}, backend.source, key)
    for dead in ledger.open(float(usage)):
        report.backend_info.setdefault("dead_runs", []).append(dead.summary())
        for lane in lanes:
            lane.report.billed_to_dead_runs_usd += dead.shares.get(lane.dataset, 0.0)
    report.backend_info["run_id"] = ledger.run
    return ledger


def _finish(run: EngineRun, started: bool) -> None:
    """Per-dataset endings and the run's totals."""
    report = run.report
    stop = report.stopped_reason
    for lane in run.lanes:
        r = lane.report
        # a fatal stop (bad key, no credits) is every dataset's ending; a cancel only of unfinished ones
        hit = stop is not None and (stop != "cancelled" or bool(lane.pending) or (r.todo - r.new - r.errors) > 0)
        lane.finish(stop if hit else None)
        if hit:
            r.fatal = report.fatal
        report.add_counts(r)
        report.lanes[lane.dataset] = r
    report.elapsed_s = time.monotonic() - run.meter.t0 if started else 0.0
    report.in_flight_peak = run.meter.peak
    report.in_flight_mean, report.full_gate_share = run.meter.figures() if started else (0.0, 0.0)
    report.client = run.loop_lag.figures() if started else {}
    if stop is None:
        endings = {lane.report.stopped_reason for lane in run.lanes} - {None}
        report.stopped_reason = "budget" if "budget" in endings else ("max_new_samples" if endings else None)
    policies = {lane.report.budget_policy for lane in run.lanes}
    report.budget_policy = policies.pop() if len(policies) == 1 else "mixed"
    for lane in run.lanes:  # run-wide figures every dataset shares
        r = lane.report
        r.elapsed_s, r.clients = report.elapsed_s, report.clients
        r.in_flight_peak, r.in_flight_mean, r.full_gate_share = (report.in_flight_peak, report.in_flight_mean,
                                                                  report.full_gate_share)
        r.client = report.client


async def run_generation(
    requests: Iterable[SampleRequest],
    backend,
    store: ResponseStore,
    budget: TokenBudget,
    *,
    sampling: SamplingSettings,
    max_tokens: int,
    concurrency: int = 256,
    policy: AdmissionPolicy | str = "expected",
    stop_event=None,
    progress: Callable[[Progress], None] | None = None,
    progress_every_s: float = 10.0,
    bar: bool = False,
    retry: RetryPolicy | None = None,
    client: ClientConfig | None = None,
    drain_timeout_s: float = 30.0,
    fsync_interval_s: float = 1.0,
    max_new_samples: int | None = None,
    preflight: bool = True,
) -> HttpGenerationReport:
    """One dataset: generate every request whose sample id is on disk in no source yet, within ``budget``.

    ``budget`` should already count the completion tokens on disk (every source). Returns the
    dataset's report with the run's figures (clients, in flight, backend info) filled in.
    """
    requests = list(requests)
    state = DatasetState.read(store)
    todo, held_back = state.todo(requests, max_new_samples)
    pol = policy if isinstance(policy, AdmissionPolicy) else AdmissionPolicy(policy)
    dataset = todo[0].dataset if todo else (requests[0].dataset if requests else "")
    job = DatasetJob(dataset, todo, store, budget, pol, state.length_stats(), planned=len(requests),
                     already_done=sum(1 for r in requests if r.sample_id in state.done_ids), held_back=held_back)
    settings = EngineSettings(concurrency=concurrency, max_tokens=max_tokens, retry=retry or RetryPolicy(),
                              client=client or ClientConfig(),
                              drain_timeout_s=drain_timeout_s, fsync_interval_s=fsync_interval_s,
                              progress_every_s=progress_every_s, bar=bar, preflight=preflight)
    run = await run_datasets([job], backend, sampling=sampling, settings=settings, stop_event=stop_event,
                             progress=progress)
    lane = run.lanes[dataset]
    lane.backend_info = run.backend_info
    if lane.fatal is None:
        lane.fatal = run.fatal
    return lane


def generate_http(*args, **kwargs) -> HttpGenerationReport:
    """Blocking wrapper of :func:`run_generation` for synchronous callers."""
    return asyncio.run(run_generation(*args, **kwargs))


def generate_datasets(*args, **kwargs) -> HttpGenerationReport:
    """Blocking wrapper of :func:`run_datasets` for synchronous callers (the ``raw_responses`` asset)."""
    return asyncio.run(run_datasets(*args, **kwargs))
