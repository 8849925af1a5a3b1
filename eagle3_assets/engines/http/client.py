"""What a backend's HTTP client needs: its connections and timeouts, and the listed prices of a paid API."""

from __future__ import annotations

from dataclasses import dataclass

import httpx


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


def client_config(settings) -> ClientConfig:
    """The client an engine's resource asks for (its ``connections_per_client`` and ``read_timeout_s``)."""
    return ClientConfig(connections_per_client=settings.connections_per_client, read_timeout_s=settings.read_timeout_s)
