"""What both loopback protocols share (SGLang's native ``/generate`` in ``sglang_app.py``, OpenRouter's
chat completions in ``openrouter_app.py``): the app base class, its statistics and the error replies.

Both keep statistics a test can read (``GET /_loopback/stats`` or ``app.stats()``): requests and
faults, what was generated per sample, server-side concurrency (``?gate=N`` adds the share of time
with 95% of N or more generation requests in progress), and for OpenRouter the dollars billed (the
exact float sum of every ``usage.cost`` sent, so a client can reconcile to the cent) and the
per-request ledger (:mod:`.ledger`: billed, delivered, billed but undelivered).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import time
from collections import Counter

from .faults import FaultPlan
from .http import HTTPServer, Reply, Request
from .observe import Observer

STATUS_OF = {"429": 429, "408": 408, "500": 500, "502": 502, "503": 503, "524": 524, "529": 529,
             "402inflight": 402, "402credits": 402, "402keylimit": 402, "401": 401, "400": 400}
MESSAGES = {
    429: "Rate limit exceeded: loopback is rate limited upstream. Please retry shortly.",
    408: "Request timed out", 500: "Internal Server Error", 502: "Provider returned error",
    503: "Provider overloaded", 524: "A timeout occurred", 529: "Provider is overloaded", 401: "User not found.",
    400: "This endpoint's maximum context length is 8192 tokens. (context_length_exceeded)",
}
ERROR_TYPES = {429: "rate_limit_exceeded", 408: "timeout", 500: "server", 502: "provider_unavailable",
               503: "provider_overloaded", 524: "timeout", 529: "provider_overloaded"}
LIMIT_SOURCES = {"402inflight": "openrouter_in_flight_budget", "402credits": "openrouter_credits",
                 "402keylimit": "openrouter_key_limit"}


def messages_key(messages) -> str:
    """A stable key of one conversation (what the OpenRouter loopback records per generation)."""
    return hashlib.sha256(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def error_reply(fault: str, retry_after_s: float) -> Reply:
    """The documented error body and headers of a status fault."""
    status = STATUS_OF[fault]
    err: dict = {"code": status, "message": MESSAGES.get(status, "error")}
    headers = {}
    if fault in LIMIT_SOURCES:
        src = LIMIT_SOURCES[fault]
        err["message"] = {
            "openrouter_in_flight_budget": "In-flight spending budget exhausted; retry after in-flight requests finish.",
            "openrouter_credits": "Insufficient credits. Add more using https://openrouter.ai/credits",
            "openrouter_key_limit": "Key limit exceeded. Raise the limit of this key.",
        }[src]
        err["metadata"] = {"limit_source": src}
        if fault == "402inflight":
            headers["Retry-After"] = f"{retry_after_s:g}"
    elif status in ERROR_TYPES:
        err["metadata"] = {"error_type": ERROR_TYPES[status], "provider_name": "Loopback"}
    if status == 400:
        err["metadata"] = {"error_type": "context_length_exceeded"}
    if status in (429, 503):
        headers["Retry-After"] = f"{retry_after_s:g}"
    return Reply.json({"error": err}, status, headers)


class LoopbackApp:
    name = "loopback"
    generation_paths: tuple[str, ...] = ()  # what the in-flight meter counts

    def __init__(self, generator, *, faults: FaultPlan | None = None, latency_s: float = 0.0,
                 latency_jitter_s: float = 0.0, latency_exponential: bool = False, latency_per_token_s: float = 0.0,
                 group_of=None, seed: int = 0):
        """Latency: ``latency_s`` (the mean of an exponential draw with ``latency_exponential``) plus
        uniform(0, ``latency_jitter_s``) before generating, plus ``latency_per_token_s`` per generated
        token after it (long replies take longer, as with a real decoder). ``group_of(body)`` names
        a request's group for the concurrency-by-group figures; ``on_request(n)``, when set, is
        called with the running count of generation requests (tests use it to kill a client)."""
        self.gen = generator
        self.faults = faults or FaultPlan()
        self.latency_s, self.latency_jitter_s = latency_s, latency_jitter_s
        self.latency_exponential, self.latency_per_token_s = latency_exponential, latency_per_token_s
        self.observer = Observer(group_of)
        self.on_request = None
        self._rng = random.Random(seed + 1)
        self.server: HTTPServer | None = None
        self.requests = 0
        self.by_status: Counter = Counter()
        self.generated: Counter = Counter()  # generations per sample key, successful replies only
        self.billed: list[float] = []
        self.completion_tokens_billed = 0
        self.started = time.time()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> HTTPServer:
        self.server = await HTTPServer(self.handle, host, port, counted=self.generation_paths.__contains__).start()
        return self.server

    async def aclose(self) -> None:
        if self.server is not None:
            await self.server.close()
        await self.gen.aclose()

    async def handle(self, req: Request) -> Reply:
        try:
            reply = await self.route(req)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a loopback bug answers 500 rather than hanging
            reply = Reply.json({"error": {"code": 500, "message": f"loopback error: {type(e).__name__}: {e}"}}, 500)
        self.by_status[reply.status if not reply.drop else "dropped"] += 1
        return reply

    async def route(self, req: Request) -> Reply:
        if req.path == "/_loopback/stats":
            gate = dict(kv.partition("=")[::2] for kv in req.query.split("&") if kv).get("gate")
            return Reply.json(self.stats(gate=int(gate) if gate else None))
        if req.path == "/_loopback/reset":
            self.reset()
            return Reply.json({"ok": True})
        if req.path == "/_loopback/config" and req.method == "POST":
            cfg = req.json() or {}
            for k in ("latency_s", "latency_jitter_s"):
                if k in cfg:
                    setattr(self, k, float(cfg[k]))
            return Reply.json({"latency_s": self.latency_s, "latency_jitter_s": self.latency_jitter_s})
        return Reply.json({"detail": "Not Found"}, 404)

    async def simulated_latency(self, fault: str) -> None:
        base = self._rng.expovariate(1.0 / self.latency_s) if self.latency_exponential and self.latency_s > 0 \
            else self.latency_s
        delay = base + (self._rng.uniform(0, self.latency_jitter_s) if self.latency_jitter_s else 0.0)
        if fault == "slow":
            delay += self.faults.slow_s
        if delay > 0:
            await asyncio.sleep(delay)

    def with_fault_shape(self, fault: str, reply: Reply) -> Reply:
        if fault == "heartbeat":
            reply.heartbeats = self.faults.heartbeats
            reply.heartbeat_interval_s = self.faults.heartbeat_interval_s
        return reply

    def reset(self) -> None:
        self.requests = 0
        self.by_status.clear()
        self.generated.clear()
        self.faults.injected.clear()
        self.observer.reset()
        if self.server is not None:
            self.server.meter.reset()

    def full_share(self, gate: int, level: float = 0.95) -> float:
        """Share of the time from the first generation request to the last reply written with at
        least ``level`` x ``gate`` of them in progress, as this server saw it (drain included)."""
        return self.server.meter.share_at_least(level * gate) if self.server else 0.0

    def stats(self, gate: int | None = None) -> dict:
        meter = self.server.meter if self.server else None
        extra = {} if gate is None else {"gate": gate, "full_gate_share": self.full_share(gate)}
        return {**extra,
            "app": self.name,
            "synthetic": bool(getattr(self.gen, "synthetic", False)),
            "requests": self.requests,
            "by_status": {str(k): v for k, v in self.by_status.items()},
            "faults": dict(self.faults.injected),
            "generated": dict(self.generated),
            "generations": sum(self.generated.values()),
            "billed_usd": math.fsum(self.billed),
            "billed_replies": len(self.billed),
            "completion_tokens_billed": self.completion_tokens_billed,
            "concurrency_peak": meter.peak if meter else 0,
            "concurrency_mean": meter.mean if meter else 0.0,
            "concurrency_now": meter.active if meter else 0,
            "concurrency_area": meter.area if meter else 0.0,  # mean over [t1, t2] = d(area) / d(time)
            "time": time.monotonic(),
            "connections_open": self.server.connections if self.server else 0,
            **self.observer.stats(),
        }
