"""Sharded HTTP clients: one ``httpx.AsyncClient`` per ~10 workers, each with exactly that many connections.

One client with a 2,000-connection pool collapses (httpcore rescans every pooled connection per
request: about 10 requests/s at 200 connections on 2 cores; ``benchmarks/http_generation.py``).
With several base URLs (SGLang data parallelism) the workers are split evenly between them, so
each server sees its own share of the gate and no more.
"""

from __future__ import annotations

import asyncio
import math
import ssl

import httpx

from eagle3_assets.engines.http.client import ClientConfig


def _ssl_context() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    try:
        import certifi

        ctx.load_verify_locations(certifi.where())
    except ImportError:  # pragma: no cover
        pass
    return ctx


class ClientShards:
    """``workers`` split over the backend's base URLs, then into shards of ``per`` connections;
    worker ``w`` always uses the same shard."""

    def __init__(self, backend, workers: int, cfg: ClientConfig):
        urls = list(backend.base_urls)
        per_url = [workers // len(urls) + (1 if i < workers % len(urls) else 0) for i in range(len(urls))]
        headers = {"Content-Type": "application/json", **backend.headers()}
        ctx = _ssl_context()
        self.clients: list[httpx.AsyncClient] = []
        self.urls: list[str] = []
        self._by_worker: list[int] = []
        for url, n in zip(urls, per_url):
            if n <= 0:
                continue
            per = n if cfg.single_client else max(1, cfg.connections_per_client)
            for s in range(math.ceil(n / per)):
                size = min(per, n - s * per)
                self.clients.append(httpx.AsyncClient(
                    headers=headers, timeout=cfg.timeout(), verify=ctx, http2=False, follow_redirects=False,
                    limits=httpx.Limits(max_connections=size, max_keepalive_connections=size,
                                        keepalive_expiry=cfg.keepalive_expiry_s),
                ))
                self.urls.append(url)
                self._by_worker.extend([len(self.clients) - 1] * size)

    def for_worker(self, w: int) -> tuple[httpx.AsyncClient, str]:
        s = self._by_worker[w]
        return self.clients[s], self.urls[s]

    def workers_per_url(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self._by_worker:
            out[self.urls[s]] = out.get(self.urls[s], 0) + 1
        return out

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients), return_exceptions=True)
