"""Typed settings of the HTTP engine: retries and the run itself (the client's connections and a
backend's listed prices are the engines' wire: ``engines/http/client.py``)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from eagle3_assets.engines.http.client import ClientConfig


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
class EngineSettings:
    """How one engine run behaves, whatever the backend.

    ``concurrency`` is the one in-flight gate shared by every dataset of the run. Replies reach
    their file with one ``write`` each as soon as they are parsed; ``fsync_interval_s`` bounds what
    a machine crash (not a killed process) can lose.
    """

    concurrency: int = 256
    max_tokens: int = 256
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    client: ClientConfig = field(default_factory=ClientConfig)
    drain_timeout_s: float = 30.0  # after a stop: how long in-flight requests may still finish
    fsync_interval_s: float = 1.0
    progress_every_s: float = 10.0
    bar: bool = False
    preflight: bool = True
