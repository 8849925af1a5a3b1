"""Figures from a timing stream: each request's send time, its tokens' arrival times and its output.

Times are client-side (``time.perf_counter`` when the request was sent and when each streamed chunk
arrived). Time to first token is first arrival - send; time per output token is the mean gap after
the first token; output tokens/s is the batch's tokens over the batch's wall time (first send to last
arrival), so it falls as requests wait for each other and rises as the engine batches them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Timed:
    """One streamed request as the client saw it."""

    prompt_id: str
    sent: float
    arrivals: list[float] = field(default_factory=list)  # one per chunk that carried tokens
    output_ids: list[int] = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # the engine's per-request counters, where it sends them

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.sent if self.arrivals else 0.0

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None for a one-token reply)."""
        n = len(self.output_ids)
        if n < 2 or not self.arrivals:
            return None
        return (self.arrivals[-1] - self.arrivals[0]) / (n - 1)


def batch_figures(timed: list[Timed]) -> dict:
    """Output tokens, wall time, tokens/s, mean TTFT and TPOT of one batch."""
    if not timed:
        raise ValueError("a batch of no requests has no figures")
    tokens = sum(len(t.output_ids) for t in timed)
    start = min(t.sent for t in timed)
    end = max((t.arrivals[-1] if t.arrivals else t.sent) for t in timed)
    wall = max(end - start, 1e-9)
    tpots = [x for t in timed if (x := t.tpot) is not None]
    return {"requests": len(timed), "output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_s": sum(t.ttft for t in timed) / len(timed),
            "tpot_s": sum(tpots) / len(tpots) if tpots else None}


def speedup(figures: dict, baseline: dict) -> float | None:
    """Output tokens/s over the baseline's (same engine, concurrency and category)."""
    b = baseline.get("tokens_per_s") or 0.0
    return figures["tokens_per_s"] / b if b > 0 else None
