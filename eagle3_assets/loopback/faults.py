"""Seeded fault injection for the loopback servers: probabilities, a scripted sequence, or both.

A spec string lists faults with probabilities, e.g. ``"429=0.1,502=0.05,heartbeat=0.2,drop=0.02"``;
a script is a comma-separated sequence consumed one entry per generation request in arrival order
(``"ok,429,ok,401"``), after which ``then`` (a fault name) applies to every later request, or the
probabilities when ``then`` is empty. ``ok`` means no fault.

Faults (wire formats follow the OpenRouter and SGLang documentation):

=============  ======================================================================================
``429``        429 with ``Retry-After`` and ``{"error": {"code": 429, ...}}``
``408``        408 timeout
``500``        500 server error
``502``        502 provider unavailable
``503``        503 overloaded, with ``Retry-After``
``524``        524 edge timeout
``529``        529 provider overloaded
``error200``   200 whose body is ``{"error": {...}}`` (provider failed after the status was sent)
``finish_error`` 200 with ``choices[0].finish_reason == "error"`` and partial content, not billed
               (SGLang: ``finish_reason {"type": "abort", "status_code": 500}``)
``heartbeat``  a normal reply preceded by blank-line heartbeats (chunked, status already 200)
``slow``       a normal reply after an extra delay
``drop``       the connection is closed without any reply
``billed_drop`` the reply is generated and billed (OpenRouter), then the connection is closed before
               it is sent: the client sees a disconnect, the key's usage grows
``402inflight`` 402 ``limit_source: openrouter_in_flight_budget`` with ``Retry-After`` (retryable)
``402credits`` 402 ``limit_source: openrouter_credits`` (stop the run)
``402keylimit`` 402 ``limit_source: openrouter_key_limit`` (stop the run)
``401``        401 bad key (stop the run)
``400``        400 invalid request (``context_length_exceeded``; not retryable)
=============  ======================================================================================
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from dataclasses import dataclass, field

FAULTS = (
    "ok", "429", "408", "500", "502", "503", "524", "529", "error200", "finish_error", "heartbeat",
    "slow", "drop", "billed_drop", "402inflight", "402credits", "402keylimit", "401", "400",
)


def parse_spec(spec: str | None) -> dict[str, float]:
    probs: dict[str, float] = {}
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        name, _, p = part.partition("=")
        name = name.strip()
        if name not in FAULTS:
            raise ValueError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
        probs[name] = float(p) if p else 1.0
    if sum(probs.values()) > 1.0 + 1e-9:
        raise ValueError(f"fault probabilities sum to more than 1: {spec}")
    return probs


@dataclass
class FaultPlan:
    probabilities: dict[str, float] = field(default_factory=dict)
    script: list[str] = field(default_factory=list)
    then: str = ""
    seed: int = 0
    retry_after_s: float = 1.0
    slow_s: float = 2.0
    heartbeats: int = 3
    heartbeat_interval_s: float = 0.05

    def __post_init__(self):
        for name in list(self.script) + ([self.then] if self.then else []):
            if name not in FAULTS:
                raise ValueError(f"unknown fault {name!r}")
        self._rng = random.Random(self.seed)
        self._i = 0
        self._lock = threading.Lock()
        self.injected: Counter = Counter()

    @classmethod
    def from_strings(cls, spec: str | None = None, script: str | None = None, **kw) -> FaultPlan:
        steps = [s.strip() for s in (script or "").split(",") if s.strip()]
        return cls(parse_spec(spec), steps, **kw)

    def next(self) -> str:
        """The fault for the next generation request."""
        with self._lock:
            i = self._i
            self._i += 1
            if i < len(self.script):
                fault = self.script[i]
            elif self.then:
                fault = self.then
            else:
                r, acc, fault = self._rng.random(), 0.0, "ok"
                for name, p in self.probabilities.items():
                    acc += p
                    if r < acc:
                        fault = name
                        break
            self.injected[fault] += 1
            return fault
