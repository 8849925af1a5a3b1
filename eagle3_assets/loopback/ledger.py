"""The OpenRouter loopback's own bill, one entry per generation request, kept by the server alone.

Tests check a client's dollars against this record rather than against a figure the client reads
back: each entry says whether the request was billed, for how much, and whether its reply reached
the socket (``delivered``) or not (``lost``: dropped after billing, or the client had hung up by the
time the generation finished - a provider bills a non-streaming generation whose client vanished).

    billed                = delivered + billed_undelivered      (dollars, exact float sums)
    the key's usage (/key) = usage before the server started + billed
"""

from __future__ import annotations

import contextvars
import math
import time
from dataclasses import asdict, dataclass

_current: contextvars.ContextVar[LedgerEntry | None] = contextvars.ContextVar("loopback_ledger_entry", default=None)


@dataclass
class LedgerEntry:
    n: int  # arrival order among generation requests
    key: str  # the conversation's key (messages_key)
    received_at: float  # wall clock
    status: int | None = None  # the reply's HTTP status (None while in progress)
    cost_usd: float = 0.0
    billed: bool = False
    generation_id: str | None = None
    delivered_at: float | None = None  # the reply's last byte was handed to the socket
    lost: str | None = None  # why it never got there: dropped, client_gone, write_failed

    @property
    def state(self) -> str:
        if self.delivered_at is not None:
            return "delivered"
        if self.lost is not None:
            return "lost"
        return "in_progress" if self.status is None else "sending"


class Ledger:
    def __init__(self):
        self.entries: list[LedgerEntry] = []

    def open(self, key: str) -> LedgerEntry:
        """A new generation request; billing inside the handler goes to it (:meth:`bill`)."""
        entry = LedgerEntry(len(self.entries) + 1, key, time.time())
        self.entries.append(entry)
        _current.set(entry)
        return entry

    @staticmethod
    def bill(cost: float, generation_id: str | None = None) -> None:
        """Bill the request being handled (the caller's task)."""
        entry = _current.get()
        if entry is not None:
            entry.cost_usd, entry.billed, entry.generation_id = cost, True, generation_id

    @staticmethod
    def follow(entry: LedgerEntry, reply) -> None:
        """Record where the reply went: its status now, then delivered or lost."""
        entry.status = 0 if reply.drop else reply.status
        sent, lost = reply.on_sent, reply.on_lost

        def on_sent():
            entry.delivered_at = time.time()
            if sent is not None:
                sent()

        def on_lost(why: str):
            entry.lost = why
            if lost is not None:
                lost(why)

        reply.on_sent, reply.on_lost = on_sent, on_lost

    def totals(self) -> dict:
        billed = [e for e in self.entries if e.billed]
        delivered = [e for e in billed if e.delivered_at is not None]
        undelivered = [e for e in billed if e.lost is not None]
        return {
            "requests": len(self.entries),
            "billed": len(billed), "billed_usd": math.fsum(e.cost_usd for e in billed),
            "delivered": len(delivered), "delivered_usd": math.fsum(e.cost_usd for e in delivered),
            "billed_undelivered": len(undelivered),
            "billed_undelivered_usd": math.fsum(e.cost_usd for e in undelivered),
            "client_gone": sum(1 for e in self.entries if e.lost == "client_gone"),
            "in_progress": sum(1 for e in self.entries if e.state in ("in_progress", "sending")),
        }

    def rows(self) -> list[dict]:
        return [{**asdict(e), "state": e.state} for e in self.entries]

    def reset(self) -> None:
        self.entries = []
