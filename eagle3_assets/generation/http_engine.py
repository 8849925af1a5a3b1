"""Generation at scale over HTTP: one async engine under the SGLang and OpenRouter backends.

The asynchronous sibling of :mod:`local_generation`. Resumable by sample id across every source
on disk, so a dataset can be started on one backend and finished on another.

Design (see the bulk-generation reference for the evidence behind each choice):

* **Concurrency gate**: a fixed pool of ``concurrency`` worker coroutines (not one task per
  sample), each with at most one HTTP request in flight.
* **Sharded clients**: one ``httpx.AsyncClient`` per ~10 workers (``connections_per_client``),
  each with an explicit pool of exactly that many connections, so no pool ever queues and
  httpcore's per-request scan over pooled connections stays short. One client with a 2,000
  connection pool collapses (about 10 requests/s at 200 connections on 2 cores); see
  ``benchmarks/http_generation.py``. With several base URLs (SGLang data parallelism) each
  shard talks to one of them, round-robin.
* **Budget at admission**: a worker reserves ``max_tokens`` before it takes a sample and settles
  with the reply's ``completion_tokens`` (reasoning included); when nothing fits it waits for
  in-flight requests to settle, and stops once nothing is in flight and nothing fits. The budget
  is never exceeded as long as servers respect ``max_tokens``.
* **Retries**: :func:`classify` turns (HTTP status, body) into ok / retry / fail / stop.
  Retries back off exponentially with jitter, honour ``Retry-After``, and 429 or in-flight 402
  set a cooldown shared by every worker. 401 and credit or key-limit 402 stop the run cleanly.
  Non-retryable failures are recorded per sample in the errors file; ``length`` finishes are
  data and are never bought again.
* **One writer task** drains an ``asyncio.Queue`` into :meth:`ResponseWriter.write_batch`
  (whole fsync'd lines, small batches, on a thread so the loop keeps serving).
* **Cancellation**: ``stop_event`` (``threading.Event`` or ``asyncio.Event``) stops admissions,
  lets in-flight requests end within ``drain_timeout_s``, then cancels the rest, flushes and
  returns; what is on disk is complete lines, so the next run resumes.
* **Secrets**: the backend's credential lives only in client headers; every message that reaches
  a log, a row, the errors file, the report or an exception passes through ``backend.redact``.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import math
import random
import ssl
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from eagle3_assets.generation.budget import TokenBudget
from eagle3_assets.generation.response_store import ResponseStore, now_iso
from eagle3_assets.generation.samples import SampleRequest, SamplingSettings

log = logging.getLogger("eagle3_assets.http")

# --------------------------------------------------------------------------------------------
# classification


@dataclass(frozen=True)
class Outcome:
    """What to do with one reply: ``ok`` (keep), ``retry``, ``fail`` (this sample, non-retryable)
    or ``stop`` (the whole run: bad key, no credits)."""

    kind: str
    reason: str
    retry_after: float | None = None
    cooldown: bool = False  # every worker pauses (rate limits, in-flight budget)
    message: str = ""
    status: int | None = None

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


def _parse_json(body) -> tuple[Any, bool]:
    if isinstance(body, (dict, list)) or body is None:
        return body, body is not None
    if isinstance(body, (bytes, bytearray)):
        body = bytes(body).decode("utf-8", errors="replace")
    text = str(body).strip()  # OpenRouter may send blank-line heartbeats before the JSON
    if not text:
        return None, False
    try:
        return json.loads(text), True
    except ValueError:
        return None, False


def parse_retry_after(value) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date)."""
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except (TypeError, ValueError):
        pass
    try:
        when = email.utils.parsedate_to_datetime(str(value))
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time()) if when else None


def _error_message(err) -> str:
    if isinstance(err, dict):
        msg = err.get("message")
        return (msg if isinstance(msg, str) else json.dumps(msg))[:500] if msg is not None else ""
    return str(err)[:500] if err else ""


def classify(status: int, body, headers=None) -> Outcome:
    """Classify one HTTP reply by its status, an error object in a 200 body, and its finish reason.

    ``body`` is the raw bytes/str (leading whitespace allowed) or parsed JSON; ``headers`` any
    mapping (only ``Retry-After`` is read). Pure and side-effect free.
    """
    data, parsed = _parse_json(body)
    err = data.get("error") if isinstance(data, dict) else None
    msg = _error_message(err) if err else ""
    ra = None
    if headers is not None:
        ra = parse_retry_after(headers.get("retry-after") if hasattr(headers, "get") else None)
        if ra is None and hasattr(headers, "get"):
            ra = parse_retry_after(headers.get("Retry-After"))
    if ra is None and isinstance(err, dict) and isinstance(err.get("availability"), dict):
        ra = parse_retry_after(err["availability"].get("retry_after"))

    if 200 <= status < 300:
        if not parsed:
            return Outcome("retry", "invalid_body", ra, status=status, message="the body is not JSON")
        if isinstance(data, list):
            if not data or not isinstance(data[0], dict):
                return Outcome("retry", "empty_body", ra, status=status)
            data = data[0]
            err = data.get("error")
            msg = _error_message(err) if err else ""
        if err:
            code = err.get("code") if isinstance(err, dict) else None
            if isinstance(code, int) and code in (401, 402):
                sub = classify(code, {"error": err})
                return Outcome(sub.kind, sub.reason, ra or sub.retry_after, sub.cooldown, msg, status)
            if isinstance(code, int) and 400 <= code < 500 and code not in (408, 429):
                return Outcome("fail", f"error_in_body_{code}", ra, message=msg, status=status)
            return Outcome("retry", "error_in_body", ra, message=msg, status=status)
        choices = data.get("choices")
        if choices is not None:  # OpenAI / OpenRouter shape
            if not choices or not isinstance(choices[0], dict):
                return Outcome("retry", "no_choices", ra, status=status)
            c0 = choices[0]
            fr = c0.get("finish_reason")
            if c0.get("error") or fr == "error":
                return Outcome("retry", "finish_error", ra, message=_error_message(c0.get("error")), status=status)
            if fr is None:
                return Outcome("retry", "no_finish_reason", ra, status=status)
            if fr == "content_filter":
                return Outcome("fail", "content_filter", status=status)
            return Outcome("ok", str(fr), status=status)
        meta = data.get("meta_info")
        if isinstance(meta, dict):  # SGLang native shape
            fr = meta.get("finish_reason")
            if fr is None:
                return Outcome("retry", "no_finish_reason", ra, status=status)
            kind = fr.get("type") if isinstance(fr, dict) else str(fr)
            if kind == "abort":
                sc = fr.get("status_code") if isinstance(fr, dict) else None
                amsg = str(fr.get("message", ""))[:500] if isinstance(fr, dict) else ""
                if isinstance(sc, int) and 400 <= sc < 500 and sc not in (408, 429):
                    return Outcome("fail", f"abort_{sc}", message=amsg, status=status)
                return Outcome("retry", "abort", ra, message=amsg, status=status)
            return Outcome("ok", str(kind), status=status)
        return Outcome("fail", "unrecognized_body", status=status)

    if status == 401:
        return Outcome("stop", "unauthorized", message=msg, status=status)
    if status == 402:
        meta = err.get("metadata") if isinstance(err, dict) else None
        source = str((meta or {}).get("limit_source", "")) if isinstance(meta, dict) else ""
        if "in_flight" in source:
            return Outcome("retry", "in_flight_budget", ra, True, msg, status)
        if "key_limit" in source:
            return Outcome("stop", "key_limit", message=msg, status=status)
        return Outcome("stop", "credits", message=msg, status=status)
    if status == 429:
        return Outcome("retry", "rate_limited", ra, True, msg, status)
    if status == 408:
        return Outcome("retry", "http_408", ra, message=msg, status=status)
    if status >= 500:  # 500, 502, 503, 504, 524, 529 ...
        return Outcome("retry", f"http_{status}", ra, message=msg, status=status)
    return Outcome("fail", f"http_{status}", message=msg, status=status)


def classify_exception(exc: BaseException) -> Outcome:
    """Transport failures (no HTTP reply) are all retryable."""
    if isinstance(exc, asyncio.TimeoutError):
        return Outcome("retry", "attempt_timeout", message="the attempt deadline passed")
    if isinstance(exc, httpx.TimeoutException):
        return Outcome("retry", "timeout", message=type(exc).__name__)
    if isinstance(exc, httpx.RemoteProtocolError):
        return Outcome("retry", "disconnected", message=type(exc).__name__)
    if isinstance(exc, (httpx.ConnectError, ConnectionError)):
        return Outcome("retry", "connect_error", message=type(exc).__name__)
    return Outcome("retry", "transport_error", message=type(exc).__name__)


# --------------------------------------------------------------------------------------------
# configuration and results


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 8  # per sample, first try included
    base_delay_s: float = 1.0
    max_delay_s: float = 60.0
    jitter: float = 0.5  # each delay is scaled by uniform(1 - jitter, 1)
    cooldown_s: float = 5.0  # shared pause after 429 / in-flight 402 without Retry-After
    max_retry_after_s: float = 300.0
    unreachable_after: int = 1000  # stop when this many transport failures happen in a row
    seed: int | None = None

    def delay(self, attempt: int, retry_after: float | None, rng: random.Random) -> float:
        d = min(self.max_delay_s, self.base_delay_s * (2 ** max(0, attempt - 1)))
        d *= rng.uniform(1.0 - self.jitter, 1.0)
        if retry_after is not None:
            d = max(d, min(retry_after, self.max_retry_after_s))
        return d


@dataclass(frozen=True)
class ClientConfig:
    connections_per_client: int = 10  # shard size: one AsyncClient per this many workers
    single_client: bool = False  # one client with a pool of `concurrency` (for comparison only)
    connect_timeout_s: float = 15.0
    read_timeout_s: float = 900.0  # the longest silent gap: a whole non-streaming generation
    write_timeout_s: float = 60.0
    attempt_timeout_s: float | None = 1800.0  # whole-attempt deadline (heartbeats reset read timeouts)
    keepalive_expiry_s: float = 60.0

    def timeout(self) -> httpx.Timeout:
        return httpx.Timeout(connect=self.connect_timeout_s, read=self.read_timeout_s,
                             write=self.write_timeout_s, pool=None)


@dataclass(frozen=True)
class Prices:
    """USD per token; used only for *estimates* before a run (rows carry the billed ``usage.cost``)."""

    prompt: float
    completion: float

    @classmethod
    def per_million(cls, prompt: float, completion: float) -> Prices:
        return cls(prompt / 1e6, completion / 1e6)


@dataclass
class Progress:
    new: int
    errors: int
    todo: int
    in_flight: int
    retries: int
    completion_tokens: int
    cost_usd: float
    elapsed_s: float

    @property
    def rows_per_s(self) -> float:
        return self.new / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        left = self.todo - self.new - self.errors
        rate = (self.new + self.errors) / self.elapsed_s if self.elapsed_s > 0 else 0.0
        return left / rate if rate > 0 else None

    @property
    def projected_cost_usd(self) -> float | None:
        """Estimate: dollars so far scaled to every sample of this run."""
        return self.cost_usd / self.new * self.todo if self.new else None

    def line(self) -> str:
        eta = f"{self.eta_s:.0f}s" if self.eta_s is not None else "?"
        proj = f" (est. ${self.projected_cost_usd:.4f} for the run)" if self.projected_cost_usd is not None else ""
        return (f"{self.new}/{self.todo} rows, {self.errors} errors, {self.in_flight} in flight, "
                f"{self.rows_per_s:.2f} rows/s, {self.completion_tokens:,} tokens ({self.tokens_per_s:.0f}/s), "
                f"${self.cost_usd:.4f}{proj}, {self.retries} retries, ETA {eta}")


@dataclass
class HttpGenerationReport:
    source: str
    planned: int
    already_done: int
    todo: int
    concurrency: int
    new: int = 0
    errors: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    reasoning_tokens: int = 0
    cost_usd: float = 0.0  # sum of usage.cost of the new rows
    cost_usd_failed: float = 0.0  # billed on attempts that did not produce a row
    attempts: int = 0  # HTTP requests sent
    retries: Counter = field(default_factory=Counter)  # by reason
    errors_by_reason: Counter = field(default_factory=Counter)
    finish_reasons: Counter = field(default_factory=Counter)
    flags: Counter = field(default_factory=Counter)  # e.g. prefix_repaired, prompt_tokens_mismatch
    left_by_budget: int = 0
    left_unstarted: int = 0  # not admitted because the run stopped
    abandoned: int = 0  # admitted, then dropped unfinished when the run stopped (no row, no error)
    stopped_reason: str | None = None  # None (finished), cancelled, budget, unauthorized, credits, ...
    fatal: str | None = None  # redacted message of the reply that stopped the run
    elapsed_s: float = 0.0
    in_flight_peak: int = 0
    in_flight_mean: float = 0.0  # time-weighted, while work was waiting to be admitted
    budget_limit: int = 0
    budget_used: int = 0
    budget_remaining: int = 0
    clients: int = 0
    backend_info: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.stopped_reason in (None, "budget", "max_new_samples")

    @property
    def achieved_concurrency(self) -> float:
        """Mean requests in flight over the gate, while samples were waiting."""
        return self.in_flight_mean / self.concurrency if self.concurrency else 0.0

    @property
    def rows_per_s(self) -> float:
        return self.new / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def summary(self) -> dict:
        """Flat, JSON-friendly figures (for Dagster metadata)."""
        return {
            "source": self.source, "planned": self.planned, "already_done": self.already_done,
            "todo": self.todo, "new": self.new, "errors": self.errors,
            "completion_tokens": self.completion_tokens, "prompt_tokens": self.prompt_tokens,
            "reasoning_tokens": self.reasoning_tokens, "cost_usd": self.cost_usd,
            "cost_usd_failed": self.cost_usd_failed, "attempts": self.attempts,
            "retries": dict(self.retries), "errors_by_reason": dict(self.errors_by_reason),
            "finish_reasons": dict(self.finish_reasons), "flags": dict(self.flags),
            "left_by_budget": self.left_by_budget, "left_unstarted": self.left_unstarted, "abandoned": self.abandoned,
            "stopped_reason": self.stopped_reason, "fatal": self.fatal,
            "elapsed_s": round(self.elapsed_s, 3), "rows_per_s": round(self.rows_per_s, 3),
            "tokens_per_s": round(self.tokens_per_s, 1), "concurrency": self.concurrency,
            "in_flight_peak": self.in_flight_peak, "in_flight_mean": round(self.in_flight_mean, 1),
            "achieved_concurrency": round(self.achieved_concurrency, 4), "clients": self.clients,
            "budget_limit": self.budget_limit, "budget_used": self.budget_used,
            "budget_remaining": self.budget_remaining, "backend_info": self.backend_info,
        }


class BackendUnavailable(RuntimeError):
    """The backend failed its pre-run health check."""


class RunStopped(RuntimeError):
    """Raised by :func:`raise_for_stop` for a run that stopped on 401 / credits / key limit."""


def raise_for_stop(report: HttpGenerationReport) -> HttpGenerationReport:
    if not report.ok and report.stopped_reason != "cancelled":
        raise RunStopped(f"{report.source} run stopped: {report.stopped_reason}: {report.fatal or ''}".strip())
    return report


# --------------------------------------------------------------------------------------------
# the plan before a run


@dataclass
class RunPlan:
    planned: int
    done: int
    done_by_source: dict
    todo: int
    budget_limit: int
    budget_used: int  # completion tokens already on disk, every source
    budget_remaining: int
    max_tokens: int
    fits_worst_case: int  # samples that fit if every one runs to max_tokens
    expected_completion_tokens: float | None  # mean completion tokens on disk, if any
    fits_expected: int | None
    projected_prompt_tokens: float | None
    projected_completion_tokens: float | None
    projected_cost_usd: float | None  # an ESTIMATE at the given prices; rows record billed cost
    cost_is_estimate: bool = True

    def summary(self) -> dict:
        return dict(self.__dict__)


def plan_remaining(requests: list[SampleRequest], store: ResponseStore, budget_limit: int, *, max_tokens: int,
                   prices: Prices | None = None, prompt_tokens: Callable[[SampleRequest], int] | None = None,
                   ) -> RunPlan:
    """What is left to do: samples and tokens remaining under the budget, across every source on disk,
    and projected dollars at ``prices`` (an estimate; prompt sizes from ``prompt_tokens`` or the
    mean of the rows on disk)."""
    rows = store.rows()
    done_ids = {r["sample_id"] for r in rows}
    by_source = Counter(r.get("source") for r in rows)
    todo = [r for r in requests if r.sample_id not in done_ids]
    used = sum(r.get("completion_tokens") or 0 for r in rows)
    remaining = budget_limit - used
    worst = min(len(todo), max(0, remaining) // max_tokens) if max_tokens > 0 else 0
    ct = [r["completion_tokens"] for r in rows if r.get("completion_tokens") is not None]
    mean_ct = sum(ct) / len(ct) if ct else None
    fits_expected = min(len(todo), int(max(0, remaining) // max(mean_ct, 1))) if mean_ct else None
    n = fits_expected if fits_expected is not None else worst
    if prompt_tokens is not None:
        sizes = [prompt_tokens(r) for r in todo[:n]]
        proj_prompt = float(sum(sizes))
    else:
        pt = [r["prompt_tokens"] for r in rows if r.get("prompt_tokens") is not None]
        proj_prompt = (sum(pt) / len(pt) * n) if pt else None
    proj_completion = (mean_ct * n) if mean_ct is not None else float(n * max_tokens)
    cost = None
    if prices is not None:
        cost = (proj_prompt or 0.0) * prices.prompt + proj_completion * prices.completion
    return RunPlan(len(requests), len(requests) - len(todo), dict(by_source), len(todo), budget_limit, used,
                   remaining, max_tokens, worst, mean_ct, fits_expected, proj_prompt, proj_completion, cost)


# --------------------------------------------------------------------------------------------
# the engine


class _Shards:
    """``n`` AsyncClients of ``per`` connections; worker ``w`` always uses shard ``w // per``."""

    def __init__(self, backend, workers: int, cfg: ClientConfig):
        per = workers if cfg.single_client else max(1, cfg.connections_per_client)
        self.per = per
        n = max(1, math.ceil(workers / per))
        ctx = ssl.create_default_context()
        try:
            import certifi

            ctx.load_verify_locations(certifi.where())
        except ImportError:  # pragma: no cover
            pass
        headers = {"Content-Type": "application/json", **backend.headers()}
        urls = backend.base_urls
        self.clients = [
            httpx.AsyncClient(
                headers=headers, timeout=cfg.timeout(), verify=ctx, http2=False, follow_redirects=False,
                limits=httpx.Limits(max_connections=per, max_keepalive_connections=per,
                                    keepalive_expiry=cfg.keepalive_expiry_s),
            )
            for _ in range(n)
        ]
        self.urls = [urls[i % len(urls)] for i in range(n)]

    def for_worker(self, w: int) -> tuple[httpx.AsyncClient, str]:
        s = w // self.per
        return self.clients[s], self.urls[s]

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients), return_exceptions=True)


class _Run:
    def __init__(self, backend, store, budget, report, *, sampling, max_tokens, concurrency, stop_event,
                 progress, progress_every_s, bar, retry, client_cfg, drain_timeout_s, writer_batch, todo):
        self.backend, self.store, self.budget, self.report = backend, store, budget, report
        self.sampling, self.max_tokens, self.concurrency = sampling, max_tokens, concurrency
        self.external_stop = stop_event
        self.progress_cb, self.progress_every_s = progress, progress_every_s
        self.retry, self.client_cfg, self.drain_timeout_s = retry, client_cfg, drain_timeout_s
        self.writer_batch = writer_batch
        self.pending: deque = deque(todo)
        self.stopping = asyncio.Event()
        self.budget_changed = asyncio.Event()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rng = random.Random(retry.seed)
        self.cooldown_until = 0.0
        self.in_flight = 0
        self._area = 0.0
        self._area_t = time.monotonic()
        self._admit_closed_at: float | None = None
        self.t0 = time.monotonic()
        self.transport_failures_in_row = 0
        self.writer_error: BaseException | None = None
        self.budget_exhausted = False
        self.costs: list[float] = []  # summed exactly (math.fsum) at the end
        self.bar = None
        self._bar_t = 0.0

    # -- bookkeeping ---------------------------------------------------------------------
    def _account(self, delta: int) -> None:
        now = time.monotonic()
        if self._admit_closed_at is None:
            self._area += self.in_flight * (now - self._area_t)
        self._area_t = now
        self.in_flight += delta
        self.report.in_flight_peak = max(self.report.in_flight_peak, self.in_flight)

    def _close_admissions(self) -> None:
        if self._admit_closed_at is None:
            self._account(0)
            self._admit_closed_at = time.monotonic()

    def stop(self, reason: str, message: str = "") -> None:
        if not self.stopping.is_set():
            self.report.stopped_reason = reason
            if message:
                self.report.fatal = self.backend.redact(message)
            self.stopping.set()
            self._close_admissions()
            log.log(logging.INFO if reason == "cancelled" else logging.WARNING, "%s run stopping: %s %s",
                    self.backend.source, reason, self.backend.redact(message))

    def snapshot(self) -> Progress:
        r = self.report
        return Progress(r.new, r.errors, r.todo, self.in_flight, sum(r.retries.values()), r.completion_tokens,
                        r.cost_usd, time.monotonic() - self.t0)

    def _notify_budget(self) -> None:
        """Wake every worker waiting for budget (they re-check; the event is replaced)."""
        ev, self.budget_changed = self.budget_changed, asyncio.Event()
        ev.set()

    # -- admission -----------------------------------------------------------------------
    async def _admit(self) -> SampleRequest | None:
        """Reserve max_tokens, then take the next sample; None when the worker should exit."""
        while True:
            if self.stopping.is_set() or self.budget_exhausted or not self.pending:
                return None
            if self.budget.try_reserve(self.max_tokens):
                break
            if self.budget.reserved == 0:  # nothing in flight can free tokens: the budget is spent
                self.budget_exhausted = True  # in-flight requests still finish normally
                self._close_admissions()
                return None
            changed = self.budget_changed
            try:
                async with asyncio.timeout(1.0):
                    await changed.wait()
            except TimeoutError:
                pass
        if not self.pending or self.stopping.is_set() or self.budget_exhausted:
            self.budget.release(self.max_tokens)
            self._notify_budget()
            return None
        req = self.pending.popleft()
        if not self.pending:
            self._close_admissions()
        return req

    def _settle(self, ticket: list, actual: int | None) -> None:
        if not ticket[0]:
            return
        ticket[0] = False
        if actual is None:  # no usage reported: charge the whole reservation
            actual = self.max_tokens
            self.report.flags["usage_missing"] += 1
        if actual > self.max_tokens:  # the server ignored max_tokens; charge what it produced
            self.report.flags["over_max_tokens"] += 1
            self.budget.reserved -= self.max_tokens
            self.budget.used += actual
        else:
            self.budget.settle(self.max_tokens, actual)
        self._notify_budget()

    # -- one sample ----------------------------------------------------------------------
    async def _sleep_unless_stopping(self, seconds: float) -> bool:
        """Sleep; False when the run started stopping meanwhile."""
        if seconds <= 0:
            return not self.stopping.is_set()
        try:
            async with asyncio.timeout(seconds):
                await self.stopping.wait()
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

    async def _process(self, req: SampleRequest, client: httpx.AsyncClient, base_url: str, ticket: list) -> None:
        backend = self.backend
        try:
            prepared = backend.prepare(req, max_tokens=self.max_tokens, sampling=self.sampling)
        except Exception as e:  # noqa: BLE001 - a prompt that cannot be rendered fails alone
            self._release(ticket)
            await self.queue.put(("error", self._error_record(
                req, Outcome("fail", "prepare_failed", message=f"{type(e).__name__}: {e}"), 0, 0.0)))
            return
        attempt = 0
        while True:
            attempt += 1
            wait = self.cooldown_until - time.monotonic()
            if not await self._sleep_unless_stopping(wait):
                self._release(ticket)
                return
            path, content = backend.request(prepared, attempt)
            t_start = time.monotonic()
            self._account(+1)
            self.report.attempts += 1
            try:
                async with asyncio.timeout(self.client_cfg.attempt_timeout_s):
                    resp = await client.post(base_url + path, content=content)
                status, headers, body = resp.status_code, resp.headers, resp.content
                exc = None
            except (TimeoutError, httpx.HTTPError, OSError) as e:
                exc = e
            finally:
                self._account(-1)
            latency = time.monotonic() - t_start
            if exc is not None:
                outcome, parsed = classify_exception(exc), None
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
            cost = parsed.cost_usd if parsed is not None else None
            if outcome.ok:
                row = parsed.row
                self._settle(ticket, row.get("completion_tokens"))
                for flag in parsed.flags:
                    self.report.flags[flag] += 1
                await self.queue.put(("row", row))
                return
            if cost:
                self.report.cost_usd_failed += cost
            if outcome.kind == "stop":
                self._release(ticket)
                await self.queue.put(("error", self._error_record(req, outcome, attempt, cost)))
                self.stop(outcome.reason, outcome.message)
                return
            if outcome.kind == "fail":
                self._release(ticket)
                await self.queue.put(("error", self._error_record(req, outcome, attempt, cost)))
                return
            # retry
            log.debug("%s %s attempt %d: %s %s", backend.source, req.sample_id, attempt, outcome.reason,
                      backend.redact(outcome.message))
            if attempt >= self.retry.max_attempts:
                self._release(ticket)
                await self.queue.put(("error", self._error_record(
                    req, outcome, attempt, cost, reason=f"retries_exhausted:{outcome.reason}")))
                return
            self.report.retries[outcome.reason] += 1  # retries actually made, by the reason for each
            if outcome.cooldown:
                pause = outcome.retry_after if outcome.retry_after is not None else self.retry.cooldown_s
                self.cooldown_until = max(self.cooldown_until,
                                          time.monotonic() + min(pause, self.retry.max_retry_after_s))
            if not await self._sleep_unless_stopping(self.retry.delay(attempt, outcome.retry_after, self.rng)):
                self._release(ticket)
                return

    def _release(self, ticket: list) -> None:
        if not ticket[0]:
            return
        ticket[0] = False
        self.budget.release(self.max_tokens)
        self._notify_budget()

    async def worker(self, w: int, shards: _Shards) -> None:
        client, base_url = shards.for_worker(w)
        while True:
            req = await self._admit()
            if req is None:
                return
            ticket = [True]  # this sample holds a reservation of max_tokens until settled or released
            try:
                await self._process(req, client, base_url, ticket)
            finally:
                if ticket[0]:  # cancelled mid-request: give the reservation back
                    ticket[0] = False
                    self.budget.release(self.max_tokens)

    # -- writing -------------------------------------------------------------------------
    async def writer(self, writer) -> None:
        done = False
        while not done:
            item = await self.queue.get()
            items = [item]
            while len(items) < self.writer_batch and not self.queue.empty():
                items.append(self.queue.get_nowait())
            rows = [x for kind, x in items if kind == "row"]
            errors = [x for kind, x in items if kind == "error"]
            done = any(kind == "end" for kind, _ in items)
            if self.writer_error is not None:
                continue
            try:
                if rows:
                    await asyncio.to_thread(writer.write_batch, rows)
                if errors:
                    await asyncio.to_thread(self._append_errors, errors)
            except BaseException as e:  # noqa: BLE001 - stop the run, surface after cleanup
                self.writer_error = e
                self.stop("write_failed", f"{type(e).__name__}: {e}")
                continue
            r = self.report
            for row in rows:
                r.new += 1
                r.completion_tokens += row.get("completion_tokens") or 0
                r.prompt_tokens += row.get("prompt_tokens") or 0
                r.reasoning_tokens += row.get("reasoning_tokens") or 0
                if row.get("cost_usd"):
                    self.costs.append(row["cost_usd"])
                    r.cost_usd += row["cost_usd"]
                r.finish_reasons[row.get("finish_reason")] += 1
            for e in errors:
                r.errors += 1
                r.errors_by_reason[e["reason"]] += 1
            self._update_bar(len(rows) + len(errors))

    def _append_errors(self, errors: list[dict]) -> None:
        for e in errors:
            self.store.append_error(e)

    def _update_bar(self, n: int) -> None:
        if self.bar is None:
            return
        self.bar.update(n)
        now = time.monotonic()
        if now - self._bar_t > 0.5:
            self._bar_t = now
            r = self.report
            self.bar.set_postfix(tok=f"{r.completion_tokens:,}", usd=f"{r.cost_usd:.4f}", inflight=self.in_flight,
                                 err=r.errors, refresh=False)

    def on_worker_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:  # a bug, not a reply: stop, flush, raise
            self.stop("internal_error", f"{type(task.exception()).__name__}: {task.exception()}")

    async def ticker(self) -> None:
        while True:
            await asyncio.sleep(self.progress_every_s)
            self.progress_cb(self.snapshot())

    async def watch_external_stop(self) -> None:
        while not self.stopping.is_set():
            if self.external_stop.is_set():
                self.stop("cancelled")
                return
            await asyncio.sleep(0.05)


async def run_generation(
    requests: Iterable[SampleRequest],
    backend,
    store: ResponseStore,
    budget: TokenBudget,
    *,
    sampling: SamplingSettings,
    max_tokens: int,
    concurrency: int = 256,
    stop_event=None,
    progress: Callable[[Progress], None] | None = None,
    progress_every_s: float = 10.0,
    bar: bool = False,
    retry: RetryPolicy = RetryPolicy(),
    client: ClientConfig = ClientConfig(),
    drain_timeout_s: float = 30.0,
    max_new_samples: int | None = None,
    writer_batch: int = 64,
    preflight: bool = True,
) -> HttpGenerationReport:
    """Generate every request whose sample id is on disk in no source yet, within ``budget``.

    ``budget`` should already count the completion tokens on disk (every source). Returns a
    :class:`HttpGenerationReport`; a run stopped by 401/credits returns normally with
    ``stopped_reason`` set (use :func:`raise_for_stop` to turn that into an exception).
    Raises :class:`BackendUnavailable` when the pre-run health check fails.
    """
    requests = list(requests)
    source = backend.source
    done = store.finished_ids()
    todo = [r for r in requests if r.sample_id not in done]
    seen: set[str] = set()
    todo = [r for r in todo if not (r.sample_id in seen or seen.add(r.sample_id))]
    limited = 0
    if max_new_samples is not None and len(todo) > max_new_samples:
        limited = len(todo) - max_new_samples
        todo = todo[:max_new_samples]
    workers = max(1, min(concurrency, len(todo)))
    already = sum(1 for r in requests if r.sample_id in done)
    report = HttpGenerationReport(source, len(requests), already, len(todo), concurrency, budget_limit=budget.limit)
    run = _Run(backend, store, budget, report, sampling=sampling, max_tokens=max_tokens, concurrency=concurrency,
               stop_event=stop_event, progress=progress, progress_every_s=progress_every_s, bar=bar, retry=retry,
               client_cfg=client, drain_timeout_s=drain_timeout_s, writer_batch=writer_batch, todo=todo)
    shards = _Shards(backend, workers, client)
    report.clients = len(shards.clients)
    tasks: list[asyncio.Task] = []
    try:
        if not todo:  # nothing to buy: no health check, no request
            return report
        if preflight:
            info, stop = await backend.preflight(shards.clients[0], shards.urls)
            report.backend_info.update(info)
            if stop is not None:
                run.stop(stop.reason, stop.message)
                report.left_unstarted = len(todo)
                return report
        if bar:
            from tqdm import tqdm

            run.bar = tqdm(total=len(todo), desc=f"{source} {todo[0].dataset}", unit="sample", file=sys.stderr,
                           dynamic_ncols=True)
        run.t0 = time.monotonic()
        run._area_t = run.t0
        with store.writer(source) as writer:
            writer_task = asyncio.create_task(run.writer(writer))
            aux = []
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
                    await asyncio.wait({all_done}, timeout=drain_timeout_s)
            finally:
                # also reached when this coroutine is cancelled (Ctrl-C, a Dagster interrupt):
                # whatever happened, cancel what is left and flush every finished row to disk
                for t in tasks:
                    if not t.done():
                        t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                stopping.cancel()
                for t in aux:
                    t.cancel()
                await asyncio.gather(*aux, return_exceptions=True)
                run.queue.put_nowait(("end", None))
                await writer_task
        failures = [t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception()]
        if failures:
            raise failures[0]
        if run.writer_error is not None:
            raise RuntimeError(backend.redact(f"writing {source} rows failed: {run.writer_error}")) from None
        report.abandoned = report.todo - report.new - report.errors - len(run.pending)
        if report.stopped_reason is not None:
            report.left_unstarted = len(run.pending)
        elif run.budget_exhausted:
            report.stopped_reason = "budget"
            report.left_by_budget = len(run.pending) + limited
            limited = 0
        if limited and report.stopped_reason is None:
            report.stopped_reason = "max_new_samples"
            report.left_unstarted = limited
        if preflight and report.stopped_reason not in ("unauthorized",):
            try:
                report.backend_info.update(await backend.postflight(shards.clients[0], shards.urls))
            except Exception:  # noqa: BLE001 - reconciliation is best effort
                pass
        return report
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await shards.aclose()
        if run.bar is not None:
            run.bar.close()
        report.elapsed_s = time.monotonic() - run.t0
        end = run._admit_closed_at or time.monotonic()
        if run._admit_closed_at is None:
            run._area += run.in_flight * (end - run._area_t)
        span = end - run.t0
        report.in_flight_mean = run._area / span if span > 0 else 0.0
        report.budget_used, report.budget_remaining = budget.used, budget.remaining
        report.cost_usd = math.fsum(run.costs)
        if progress is not None:
            try:
                progress(run.snapshot())
            except Exception:  # noqa: BLE001
                pass


def generate_http(*args, **kwargs) -> HttpGenerationReport:
    """Blocking wrapper of :func:`run_generation` for synchronous callers (Dagster assets)."""
    return asyncio.run(run_generation(*args, **kwargs))
