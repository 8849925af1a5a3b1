"""The engine's run loop: one in-flight gate of worker coroutines shared by every dataset of the run.

* A fixed pool of ``concurrency`` workers (not one task per sample), each with at most one request
  in flight, takes samples from the datasets in turn (round-robin over those whose budget has
  room), so every dataset is served at once and the gate stays full while any dataset has work.
* A sample holds a :class:`~eagle3_assets.generation.admission.Reservation` on its dataset's
  budget from admission until its reply is kept (settled) or it ends without one (released).
* Retries back off exponentially with jitter and honour ``Retry-After``; 429 and in-flight 402 set a
  cooldown shared by every worker; 401 and credit or key-limit 402 stop the run cleanly.
* A kept reply is written to its dataset's file at once (see :mod:`lanes`); a background task
  fsyncs every ``fsync_interval_s``. How late the event loop runs (:mod:`loop_lag`) bounds how long
  a delivered reply waits unread.
* ``stop_event`` (``threading.Event`` or ``asyncio.Event``) stops admissions, lets in-flight
  requests end within ``drain_timeout_s``, then cancels the rest; cancelling the coroutine itself
  does the same. What is on disk is complete lines, so the next run resumes.
* Every message that reaches a log, a row, a file, the report or an exception passes through
  ``backend.redact``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import sys
import time
from collections.abc import Callable

import httpx

from eagle3_assets.engines.http.classify import Outcome, classify_exception
from eagle3_assets.engines.http.samples import SampleRequest, SamplingSettings
from eagle3_assets.engines.http.wire import now_iso
from eagle3_assets.generation.gate import GateMeter, Waiters
from eagle3_assets.generation.http_config import EngineSettings
from eagle3_assets.generation.http_report import HttpGenerationReport, Progress
from eagle3_assets.generation.lanes import Lane
from eagle3_assets.generation.loop_lag import LoopLag

log = logging.getLogger("eagle3_assets.http")
UNSEEN_EPSILON_USD = 1e-9


class EngineRun:
    def __init__(self, backend, lanes: list[Lane], settings: EngineSettings, sampling: SamplingSettings, *,
                 workers: int, stop_event=None, progress: Callable[[Progress], None] | None = None):
        self.backend, self.lanes, self.settings, self.sampling = backend, lanes, settings, sampling
        self.retry = settings.retry
        self.report = HttpGenerationReport(backend.source, concurrency=settings.concurrency)
        self.external_stop = stop_event
        self.progress_cb = progress
        self.stopping = asyncio.Event()
        self.waiters = Waiters()
        self.rng = random.Random(self.retry.seed)
        self.cooldown_until = 0.0
        self.meter = GateMeter(workers)
        self.loop_lag = LoopLag()
        self.transport_failures_in_row = 0
        self.write_error: BaseException | None = None
        self.key_ledger = None  # KeyLedger when the backend reports the key's usage
        self.bar = None
        self._bar_t = 0.0
        self._next_lane = 0

    # -- run state -----------------------------------------------------------------------------------
    def stop(self, reason: str, message: str = "") -> None:
        if self.stopping.is_set():
            return
        self.report.stopped_reason = reason
        if message:
            self.report.fatal = self.backend.redact(message)
        self.stopping.set()
        self.meter.close()
        self.waiters.wake_all()
        log.log(logging.INFO if reason == "cancelled" else logging.WARNING, "%s run stopping: %s %s",
                self.backend.source, reason, self.backend.redact(message))

    @property
    def admissions_closed(self) -> bool:
        return self.stopping.is_set() or not any(lane.admitting for lane in self.lanes)

    def snapshot(self) -> Progress:
        new = errors = todo = completion = retries = 0
        cost = 0.0
        expected = 0
        for lane in self.lanes:
            r = lane.report
            new, errors, todo = new + r.new, errors + r.errors, todo + r.todo
            completion += r.completion_tokens
            retries += sum(r.retries.values())
            cost += math.fsum(lane.costs)
            expected += r.new + r.errors + lane.gate.in_flight + self._still_fits(lane)
        stopped = self.report.stopped_reason
        if stopped is None and self.admissions_closed and any(lane.exhausted for lane in self.lanes):
            stopped = "budget" if all(lane.exhausted or not lane.pending for lane in self.lanes) else None
        return Progress(new, errors, todo, self.meter.now, retries, completion, cost, time.monotonic() - self.meter.t0,
                        expected_rows=expected, stopped=stopped, datasets=len(self.lanes),
                        datasets_done=sum(1 for lane in self.lanes if not lane.admitting))

    @staticmethod
    def _still_fits(lane: Lane) -> int:
        if not lane.admitting:
            return 0
        g = lane.gate
        mean = g.stats.overall()[0] if g.stats.count else g.max_tokens
        room = g.budget.limit - g.budget.used - g.held
        return int(min(len(lane.pending), max(0.0, room) / max(mean, 1.0)))

    # -- admission -------------------------------------------------------------------------------------
    async def admit(self) -> tuple[Lane, SampleRequest, object] | None:
        """The next sample of the next dataset whose budget has room; None when the worker should exit."""
        while True:
            if self.stopping.is_set():
                return None
            now = time.monotonic()
            waiting = False
            n = len(self.lanes)
            for i in range(n):
                lane = self.lanes[(self._next_lane + i) % n]
                if not lane.admitting:
                    continue
                got = lane.try_admit(now)
                if got is not None:
                    self._next_lane = (self._next_lane + i + 1) % n
                    if self.admissions_closed:
                        self.meter.close()
                    return lane, got[0], got[1]
                if lane.admitting:
                    waiting = True
                else:  # its budget is spent: workers waiting on it may have nothing left to do
                    self.waiters.wake_all()
            if not waiting:
                self.meter.close()
                return None
            await self.waiters.wait(0.25)

    # -- one sample ---------------------------------------------------------------------------------------
    async def _sleep_unless_stopping(self, seconds: float) -> bool:
        """Sleep; False when the run started stopping meanwhile."""
        if seconds <= 0:
            return not self.stopping.is_set()
        try:
            await asyncio.wait_for(self.stopping.wait(), seconds)
            return False
        except TimeoutError:
            return True

    def _error_record(self, req: SampleRequest, outcome: Outcome, attempts: int, cost: float | None,
                      reason: str | None = None) -> dict:
        return {
            "sample_id": req.sample_id, "dataset": req.dataset, "prompt_id": req.prompt_id,
            "sample_index": req.sample_index, "source": self.backend.source,
            "reason": reason or outcome.reason, "status": outcome.status,
            "message": self.backend.redact(outcome.message or ""), "attempts": attempts,
            "cost_usd": cost or 0.0, "created_at": now_iso(),
        }

    async def process(self, lane: Lane, req: SampleRequest, res, client: httpx.AsyncClient, base_url: str) -> None:
        backend = self.backend
        try:
            prepared = backend.prepare(req, max_tokens=self.settings.max_tokens, sampling=self.sampling)
        except Exception as e:  # noqa: BLE001 - a prompt that cannot be rendered fails alone
            lane.fail(self._error_record(req, Outcome("fail", "prepare_failed", message=f"{type(e).__name__}: {e}"),
                                         0, 0.0), res)
            return
        attempt = 0
        while True:
            attempt += 1
            if not await self._sleep_unless_stopping(self.cooldown_until - time.monotonic()):
                return
            path, content = backend.request(prepared, attempt)
            t_start = time.monotonic()
            self.meter.add(+1)
            lane.report.attempts += 1
            try:
                async with asyncio.timeout(self.settings.client.attempt_timeout_s):
                    resp = await client.post(base_url + path, content=content)
                status, headers, body = resp.status_code, resp.headers, resp.content
                exc = None
            except (TimeoutError, httpx.HTTPError, OSError) as e:
                exc = e
            finally:
                self.meter.add(-1)
            if exc is None:
                lane.answered += 1
            latency = time.monotonic() - t_start
            if exc is not None:
                outcome, parsed = classify_exception(exc), None
                lane.report.lost_attempts += 1
                self.transport_failures_in_row += 1
                if self.transport_failures_in_row >= self.retry.unreachable_after:
                    self.stop("unreachable", f"{self.transport_failures_in_row} transport failures in a row")
            else:
                self.transport_failures_in_row = 0
                try:
                    parsed = backend.parse(prepared, status, headers, body, latency_s=latency, attempts=attempt,
                                           base_url=base_url)
                    outcome = parsed.outcome
                except Exception as e:  # noqa: BLE001 - an unreadable reply fails this sample only
                    parsed = None
                    outcome = Outcome("fail", "unparseable_reply", message=f"{type(e).__name__}: {e}", status=status)
            if outcome.ok:
                try:
                    lane.keep(parsed.row, res, parsed.flags)
                except OSError as e:  # the disk refused the row: stop, keep what is written
                    self.write_error = e
                    self.stop("write_failed", f"{type(e).__name__}: {e}")
                    return
                self._update_bar()
                self.waiters.wake()
                return
            cost = parsed.cost_usd if parsed is not None else None
            if cost:
                lane.billed_without_row(req, cost, outcome.reason, attempt)
            if outcome.kind in ("stop", "fail"):
                lane.fail(self._error_record(req, outcome, attempt, cost), res)
                self._update_bar()
                self.waiters.wake()
                if outcome.kind == "stop":
                    self.stop(outcome.reason, outcome.message)
                return
            log.debug("%s %s attempt %d: %s %s", backend.source, req.sample_id, attempt, outcome.reason,
                      backend.redact(outcome.message))
            if attempt >= self.retry.max_attempts:
                lane.fail(self._error_record(req, outcome, attempt, cost, reason=f"retries_exhausted:{outcome.reason}"),
                          res)
                self._update_bar()
                self.waiters.wake()
                return
            lane.report.retries[outcome.reason] += 1  # retries actually made, by the reason for each
            if outcome.cooldown:
                pause = outcome.retry_after if outcome.retry_after is not None else self.retry.cooldown_s
                self.cooldown_until = max(self.cooldown_until,
                                          time.monotonic() + min(pause, self.retry.max_retry_after_s))
            if not await self._sleep_unless_stopping(self.retry.delay(attempt, outcome.retry_after, self.rng)):
                return

    async def worker(self, w: int, shards) -> None:
        client, base_url = shards.for_worker(w)
        while True:
            got = await self.admit()
            if got is None:
                return
            lane, req, res = got
            self.meter.hold(+1)
            try:
                await self.process(lane, req, res, client, base_url)
            finally:
                self.meter.hold(-1)
                if res.open:  # stopped or cancelled mid-request: give the reservation back
                    res.release()
                    self.waiters.wake()

    def on_worker_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:  # a bug, not a reply: stop, flush, raise
            self.stop("internal_error", f"{type(task.exception()).__name__}: {task.exception()}")

    # -- background tasks ---------------------------------------------------------------------------
    async def syncer(self) -> None:
        """fsync every dataset's files that changed, every ``fsync_interval_s``; record the attempts
        and replies so far where a later run finds them if this one dies."""
        while True:
            await asyncio.sleep(self.settings.fsync_interval_s)
            for lane in self.lanes:
                if lane.dirty:
                    try:
                        await asyncio.to_thread(lane.sync)
                    except OSError as e:
                        self.write_error = e
                        self.stop("write_failed", f"{type(e).__name__}: {e}")
            if self.key_ledger is not None:
                try:
                    self.key_ledger.checkpoint({lane.dataset: (lane.report.attempts, lane.answered)
                                                for lane in self.lanes})
                except OSError as e:
                    log.warning("%s: the run state could not be recorded: %s", self.backend.source, e)

    async def ticker(self) -> None:
        while True:
            await asyncio.sleep(self.settings.progress_every_s)
            self.progress_cb(self.snapshot())

    async def watch_external_stop(self) -> None:
        while not self.stopping.is_set():
            if self.external_stop.is_set():
                self.stop("cancelled")
                return
            await asyncio.sleep(0.05)

    def open_bar(self, total: int, label: str) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=f"{self.backend.source} {label}", unit="sample", file=sys.stderr,
                        dynamic_ncols=True)

    def _update_bar(self) -> None:
        if self.bar is None:
            return
        self.bar.update(1)
        now = time.monotonic()
        if now - self._bar_t > 0.5:
            self._bar_t = now
            tok = sum(lane.report.completion_tokens for lane in self.lanes)
            usd = sum(math.fsum(lane.costs) for lane in self.lanes)
            err = sum(lane.report.errors for lane in self.lanes)
            self.bar.set_postfix(tok=f"{tok:,}", usd=f"{usd:.4f}", inflight=self.meter.now, err=err, refresh=False)

    # -- the provider's bill -------------------------------------------------------------------------
    def apportion_unseen(self, key_usage_delta: float | None) -> None:
        """Dollars the provider billed beyond every cost a reply showed, shared by the datasets in
        proportion to their attempts that ended without a reply (else to all their attempts)."""
        if key_usage_delta is None:
            return
        seen = math.fsum([*(c for lane in self.lanes for c in lane.costs),
                          *(c for lane in self.lanes for c in lane.failed_costs)])
        unseen = key_usage_delta - seen
        self.report.backend_info["billed_seen_usd"] = seen
        self.report.backend_info["billed_unseen_usd"] = max(0.0, unseen)
        if unseen <= UNSEEN_EPSILON_USD:
            return
        weights = [lane.report.lost_attempts for lane in self.lanes]
        if not sum(weights):
            weights = [lane.report.attempts for lane in self.lanes]
        total = sum(weights) or 1
        note = {"key_usage_delta_usd": key_usage_delta, "run_billed_seen_usd": seen}
        for lane, w in zip(self.lanes, weights):
            lane.record_unseen(unseen * w / total, note)
