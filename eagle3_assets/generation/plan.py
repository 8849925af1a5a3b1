"""What a dataset holds before a run (its response files read once) and what is left to do.

``DatasetState`` is the one pass over the rows every source has on disk: finished sample ids,
tokens against the budget, dollars kept, and the recent reply lengths the ``expected`` budget
policy starts from. ``plan_remaining`` turns it into the pre-run plan that is logged and shown
in the metadata (an estimate: rows record the billed cost).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from eagle3_assets.engines.http.client import Prices
from eagle3_assets.engines.http.samples import SampleRequest
from eagle3_assets.generation.admission import LengthStats
from eagle3_assets.generation.response_store import ResponseStore

RECENT = 4096  # reply lengths kept for the budget estimator


@dataclass
class DatasetState:
    """Everything a run needs from the rows already on disk, from one read."""

    done_ids: set = field(default_factory=set)
    by_source: Counter = field(default_factory=Counter)
    rows: int = 0
    completion_tokens: int = 0
    prompt_tokens_sum: int = 0
    prompt_tokens_rows: int = 0
    cost_usd: float = 0.0
    recent: list = field(default_factory=list)  # (latency_s, completion_tokens), oldest first

    @classmethod
    def read(cls, store: ResponseStore) -> DatasetState:
        st = cls()
        costs = []
        for r in store.iter_rows():
            st.done_ids.add(r["sample_id"])
            st.by_source[r.get("source")] += 1
            st.rows += 1
            ct = r.get("completion_tokens")
            if ct is not None:
                st.completion_tokens += ct
                st.recent.append((r.get("latency_s"), ct))
            if r.get("prompt_tokens") is not None:
                st.prompt_tokens_sum += r["prompt_tokens"]
                st.prompt_tokens_rows += 1
            if r.get("cost_usd"):
                costs.append(r["cost_usd"])
        st.cost_usd = math.fsum(costs)
        st.recent = st.recent[-RECENT:]
        return st

    @property
    def mean_completion_tokens(self) -> float | None:
        return sum(t for _, t in self.recent) / len(self.recent) if self.recent else None

    def length_stats(self) -> LengthStats:
        stats = LengthStats(RECENT)
        for latency, tokens in self.recent:
            stats.add(latency, tokens)
        return stats

    def todo(self, requests: list[SampleRequest], max_new: int | None = None) -> tuple[list[SampleRequest], int]:
        """Samples on disk in no source yet (each once), at most ``max_new`` of them; and how many
        were held back by that limit."""
        seen: set[str] = set()
        out = []
        for r in requests:
            if r.sample_id in self.done_ids or r.sample_id in seen:
                continue
            seen.add(r.sample_id)
            out.append(r)
        if max_new is not None and len(out) > max_new:
            return out[:max_new], len(out) - max_new
        return out, 0


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

    def line(self) -> str:
        cost = "n/a (no prices configured)" if self.projected_cost_usd is None else \
            f"${self.projected_cost_usd:,.2f} (ESTIMATE)"
        fits = f"room for about {self.fits_expected}" if self.fits_expected is not None else \
            f"room for {self.fits_worst_case} at max_tokens"
        return (f"to do: {self.todo} samples ({self.done} on disk); budget left {self.budget_remaining:,} tokens "
                f"({fits}); projected cost {cost}")


def plan_remaining(requests: list[SampleRequest], store: ResponseStore | None, budget_limit: int, *, max_tokens: int,
                   prices: Prices | None = None, prompt_tokens: Callable[[SampleRequest], int] | None = None,
                   state: DatasetState | None = None) -> RunPlan:
    """What is left to do: samples and tokens remaining under the budget, across every source on disk,
    and projected dollars at ``prices`` (an estimate; prompt sizes from ``prompt_tokens`` or the
    mean of the rows on disk). Pass ``state`` to reuse a read of the store."""
    st = state if state is not None else DatasetState.read(store)
    todo, _ = st.todo(requests)
    used = st.completion_tokens
    remaining = budget_limit - used
    worst = min(len(todo), max(0, remaining) // max_tokens) if max_tokens > 0 else 0
    mean_ct = st.mean_completion_tokens
    fits_expected = min(len(todo), int(max(0, remaining) // max(mean_ct, 1))) if mean_ct else None
    n = fits_expected if fits_expected is not None else worst
    if prompt_tokens is not None:
        proj_prompt = float(sum(prompt_tokens(r) for r in todo[:n]))
    else:
        proj_prompt = (st.prompt_tokens_sum / st.prompt_tokens_rows * n) if st.prompt_tokens_rows else None
    proj_completion = (mean_ct * n) if mean_ct is not None else float(n * max_tokens)
    cost = None
    if prices is not None:
        cost = (proj_prompt or 0.0) * prices.prompt + proj_completion * prices.completion
    return RunPlan(len(requests), len(requests) - len(todo), dict(st.by_source), len(todo), budget_limit, used,
                   remaining, max_tokens, worst, mean_ct, fits_expected, proj_prompt, proj_completion, cost)
