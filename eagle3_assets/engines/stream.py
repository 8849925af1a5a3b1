"""A streamed request timed on the client: what both HTTP serve roles share.

``stream_request`` posts a JSON body with ``stream: true``, reads the server-sent events and hands each
event's JSON to ``parse`` (the engine's), which returns the token ids the event carries and, where
the engine sends them, its per-request counters. The arrival time of every event that carried
tokens is kept, with the send time, as a :class:`Streamed`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Streamed:
    sent: float
    arrivals: list[float] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    meta: dict = field(default_factory=dict)


class StreamError(RuntimeError):
    """The server answered with an error or closed the stream early."""


def stream_request(client, url: str, body: dict, parse: Callable[[dict, list[int]], tuple[list[int], dict | None]]) -> Streamed:
    """``parse(event, ids_so_far) -> (new ids, meta or None)``; returns the request as timed here."""
    out = Streamed(sent=time.perf_counter())
    done = False
    with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            r.read()
            raise StreamError(f"{url} answered {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            now = time.perf_counter()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                raise StreamError(f"{url} streamed an error: {str(event['error'])[:300]}")
            new, meta = parse(event, out.output_ids)
            if new:
                out.output_ids.extend(int(t) for t in new)
                out.arrivals.append(now)
            if meta:
                out.meta = meta
    if not done and not out.arrivals:
        raise StreamError(f"{url} closed the stream before any token")
    return out
