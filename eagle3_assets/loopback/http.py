"""A minimal HTTP/1.1 keep-alive server on asyncio streams, with the knobs fault injection needs.

Only what the loopback servers use: request line, headers, a ``Content-Length`` body, keep-alive,
and replies that are plain, chunked with leading whitespace heartbeats (sent after the 200 status
line, as OpenRouter does), delayed, or dropped (the connection closed with no reply).

A handler runs to its end even when the client hangs up meanwhile (a provider finishes, and bills,
a non-streaming generation whose client went away); its reply then reports ``on_lost`` instead of
``on_sent``, which is how the servers' ledgers tell delivered replies from billed, undelivered ones.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

REASONS = {
    200: "OK", 400: "Bad Request", 401: "Unauthorized", 402: "Payment Required", 403: "Forbidden",
    404: "Not Found", 408: "Request Timeout", 413: "Payload Too Large", 429: "Too Many Requests",
    500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable", 524: "A Timeout Occurred",
    529: "Site Overloaded",
}


@dataclass
class Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]  # lower-cased names
    body: bytes

    def json(self):
        return json.loads(self.body or b"null")


@dataclass
class Reply:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    heartbeats: int = 0  # whitespace chunks sent before the body (chunked encoding)
    heartbeat_interval_s: float = 0.05
    drop: bool = False  # close the connection without replying
    on_sent: Callable[[], None] | None = None  # called once the whole reply is in the socket
    on_lost: Callable[[str], None] | None = None  # called instead when it never got there, with why

    def lost(self, why: str) -> None:
        if self.on_lost is not None:
            self.on_lost(why)

    @classmethod
    def json(cls, obj, status: int = 200, headers: dict | None = None, **kw) -> Reply:
        h = {"Content-Type": "application/json"}
        h.update(headers or {})
        return cls(status, json.dumps(obj, separators=(",", ":")).encode(), h, **kw)


Handler = Callable[[Request], Awaitable[Reply]]


class ConcurrencyMeter:
    """Requests being handled right now, with the time-weighted mean, the peak, and the record of
    every change (``history``: monotonic time, count after it) for shares of time above a level."""

    def __init__(self):
        self.active = 0
        self.peak = 0
        self._area = 0.0
        self._last = None
        self._first = None
        self.history: list[tuple[float, int]] = []

    def _tick(self):
        now = time.monotonic()
        if self._last is not None:
            self._area += self.active * (now - self._last)
        else:
            self._first = now
        self._last = now

    def enter(self):
        self._tick()
        self.active += 1
        self.peak = max(self.peak, self.active)
        self.history.append((self._last, self.active))

    def leave(self):
        self._tick()
        self.active -= 1
        self.history.append((self._last, self.active))

    def reset(self):
        """Start a new measurement; requests still being handled keep counting."""
        self.peak = self.active
        self._area = 0.0
        self._first = self._last = time.monotonic() if self.active else None
        self.history = [(self._first, self.active)] if self.active else []

    def share_at_least(self, level: float, start: float | None = None, end: float | None = None) -> float:
        """Share of [start, end] (default: the first change to the last) with ``level`` or more in
        progress."""
        h = self.history
        if not h:
            return 0.0
        start = h[0][0] if start is None else start
        end = h[-1][0] if end is None else end
        if end <= start:
            return 0.0
        above = 0.0
        for i, (t, n) in enumerate(h):  # a step function: n from t until the next change
            lo, hi = max(t, start), min(h[i + 1][0] if i + 1 < len(h) else end, end)
            if n >= level and hi > lo:
                above += hi - lo
        return above / (end - start)

    @property
    def area(self) -> float:
        """Integral of the active count over time, up to now."""
        now = time.monotonic()
        return self._area + (self.active * (now - self._last) if self._last is not None else 0.0)

    @property
    def mean(self) -> float:
        if self._first is None or self._last == self._first:
            return 0.0
        return self._area / (self._last - self._first)


class HTTPServer:
    """Serves one handler on 127.0.0.1; ``meter`` counts requests in progress, from the request's
    last byte read to the reply's last byte written (those whose path ``counted`` accepts: the
    generation requests, not statistics or key look-ups)."""

    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0,
                 counted: Callable[[str], bool] | None = None):
        self.handler, self.host, self.port = handler, host, port
        self.counted = counted or (lambda path: True)
        self.meter = ConcurrencyMeter()
        self.connections = 0
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> HTTPServer:
        self._server = await asyncio.start_server(self._serve, self.host, self.port, backlog=4096, limit=1 << 22)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in list(self._writers):
                w.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, target, version = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if line:
                        k, _, v = line.partition(":")
                        headers[k.strip().lower()] = v.strip()
                body = b""
                n = int(headers.get("content-length", "0") or 0)
                if n:
                    body = await reader.readexactly(n)
                path, _, query = target.partition("?")
                counted = self.counted(path)
                if counted:
                    self.meter.enter()
                try:
                    reply = await self.handler(Request(method, path, query, headers, body))
                    if reply.drop:
                        reply.lost("dropped")
                        writer.transport.abort()
                        return
                    if reader.at_eof() or reader.exception() is not None:  # the client hung up meanwhile
                        reply.lost("client_gone")
                        return
                    try:
                        await self._write(writer, reply)
                    except (ConnectionError, asyncio.IncompleteReadError):
                        reply.lost("write_failed")
                        raise
                    if reply.on_sent is not None:
                        reply.on_sent()
                finally:
                    if counted:
                        self.meter.leave()
                if headers.get("connection", "").lower() == "close" or version == "HTTP/1.0":
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._writers.discard(writer)
            self.connections -= 1
            if not writer.is_closing():
                writer.close()

    async def _write(self, writer: asyncio.StreamWriter, reply: Reply) -> None:
        status_line = f"HTTP/1.1 {reply.status} {REASONS.get(reply.status, 'Status')}\r\n"
        hdrs = dict(reply.headers)
        if reply.heartbeats:
            hdrs["Transfer-Encoding"] = "chunked"
            head = status_line + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items()) + "\r\n"
            writer.write(head.encode("latin-1"))
            for _ in range(reply.heartbeats):
                writer.write(b"1\r\n\n\r\n")
                await writer.drain()
                await asyncio.sleep(reply.heartbeat_interval_s)
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(reply.body), reply.body))
        else:
            hdrs["Content-Length"] = str(len(reply.body))
            head = status_line + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items()) + "\r\n"
            writer.write(head.encode("latin-1") + reply.body)
        await writer.drain()
