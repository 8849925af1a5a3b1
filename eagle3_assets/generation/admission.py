"""Admission against one dataset's token budget: may one more request start, and what does it hold?

Two policies, chosen per dataset:

* ``strict`` - every request holds ``max_tokens`` until its reply settles, so the budget is never
  exceeded, but in flight can never pass ``remaining / max_tokens``: with thinking replies
  (``max_tokens`` of 16-32k, mean ~3k) that caps a 2,000 gate at a few hundred from the start.
* ``expected`` (default) - a request holds the tokens it is *expected* to produce, learned from the
  dataset's finished replies (on disk and in this run), and one more is admitted while
  ``used + held + its estimate + spread`` fits the budget (plus ``tolerance``, 0 by default); the spread
  is ``z`` standard deviations of everything held, or a lone long reply's excess when few requests
  are in flight. A request that has been in flight for a while is re-estimated from the replies
  that took at least as long (long replies take longer, so the requests still running at the end
  are the long ones), and holds ``max_tokens`` when fewer than ``min_tail`` replies ever took as
  long. A new request is expected to hold the mean over the finished replies and those in flight,
  so early in a run, while only the short replies are back, estimates stay high. Until ``min_rows``
  replies are known the policy is strict. The gate stays full until the projected total meets the
  budget; the report states the realized overshoot.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from eagle3_assets.generation.budget import TokenBudget

POLICIES = ("expected", "strict")
# How far above its budget an ``expected``-policy dataset may end and still pass the budget check.
EXPECTED_OVERSHOOT_ALLOWANCE = 0.01


@dataclass(frozen=True)
class AdmissionPolicy:
    """Per-dataset choice: ``kind`` one of POLICIES. For ``expected``: one more request is admitted
    while ``used + held + its estimate + spread <= budget * (1 + tolerance)``, where ``spread`` is the
    larger of ``z`` standard deviations of everything held (many requests in flight) and the excess of
    a ``tail_quantile`` reply over the mean (few requests in flight, at the end); ``min_rows`` replies
    are needed before estimates replace ``max_tokens``."""

    kind: str = "expected"
    z: float = 2.0
    tail_quantile: float = 0.99  # a lone reply can run to this quantile of the lengths seen
    tolerance: float = 0.0  # share of the budget an expected-policy run may end above it
    min_rows: int = 16
    min_tail: int = 8  # replies at least as long-running as a request, to re-estimate it by its age
    refresh_s: float = 0.25

    def __post_init__(self):
        if self.kind not in POLICIES:
            raise ValueError(f"unknown budget policy {self.kind!r}; expected one of {POLICIES}")


class LengthStats:
    """The dataset's finished replies as (latency seconds, completion tokens), most recent ``keep``."""

    def __init__(self, keep: int = 4096):
        self._pairs: deque = deque(maxlen=keep)
        self.count = 0  # every reply seen, also beyond ``keep``
        self._dirty = True
        self._lat = np.zeros(0)
        self._suffix_n = np.zeros(1)
        self._suffix_sum = np.zeros(1)
        self._suffix_sq = np.zeros(1)
        self._tokens_sorted = np.zeros(0)

    def add(self, latency_s: float | None, tokens: int) -> None:
        self._pairs.append((float(latency_s) if latency_s is not None else 0.0, float(tokens)))
        self.count += 1
        self._dirty = True

    def _rebuild(self) -> None:
        if not self._dirty:
            return
        arr = np.array(self._pairs, dtype=np.float64).reshape(-1, 2)
        order = np.argsort(arr[:, 0], kind="stable")
        lat, tok = arr[order, 0], arr[order, 1]
        self._lat = lat
        # suffix sums over replies sorted by latency: [i] covers replies i..end
        self._suffix_n = np.arange(len(lat), -1, -1, dtype=np.float64)
        self._suffix_sum = np.concatenate([np.cumsum(tok[::-1])[::-1], [0.0]])
        self._suffix_sq = np.concatenate([np.cumsum((tok * tok)[::-1])[::-1], [0.0]])
        self._tokens_sorted = np.sort(tok)
        self._dirty = False

    def quantile(self, q: float) -> float:
        self._rebuild()
        if not len(self._tokens_sorted):
            return 0.0
        return float(self._tokens_sorted[min(len(self._tokens_sorted) - 1, int(q * len(self._tokens_sorted)))])

    @property
    def window(self) -> int:
        """Replies the estimates are computed from (the most recent ``keep``)."""
        return len(self._pairs)

    def overall(self) -> tuple[float, float]:
        """Mean and variance of every kept reply's tokens."""
        self._rebuild()
        n = self._suffix_n[0]
        if n == 0:
            return 0.0, 0.0
        mean = self._suffix_sum[0] / n
        return mean, max(0.0, self._suffix_sq[0] / n - mean * mean)

    def given_ages(self, ages: np.ndarray, min_tail: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per age: mean and variance of the tokens of replies that took at least that long, and
        whether at least ``min_tail`` replies did (if not, nothing is known about such a request)."""
        self._rebuild()
        idx = np.searchsorted(self._lat, ages, side="left")
        n = self._suffix_n[idx]
        known = n >= min_tail
        safe_n = np.where(n > 0, n, 1.0)
        mean = self._suffix_sum[idx] / safe_n
        var = np.maximum(0.0, self._suffix_sq[idx] / safe_n - mean * mean)
        return mean, var, known


class Reservation:
    """One admitted sample's hold on its dataset's budget until it is settled (a reply kept) or
    released (no reply); both are idempotent, so every exit path may call them."""

    __slots__ = ("gate", "started", "tokens", "var", "open")

    def __init__(self, gate: BudgetGate, started: float, tokens: float, var: float):
        self.gate, self.started, self.tokens, self.var, self.open = gate, started, tokens, var, True

    def settle(self, actual: int | None) -> None:
        if self.open:
            self.gate._close(self, actual)

    def release(self) -> None:
        if self.open:
            self.gate._close(self, None, charge=False)


class BudgetGate:
    """Admission for one dataset. ``budget.used`` counts settled tokens (those on disk included);
    ``budget.reserved`` mirrors the tokens held by requests in flight."""

    def __init__(self, budget: TokenBudget, max_tokens: int, policy: AdmissionPolicy | None = None,
                 stats: LengthStats | None = None):
        self.budget = budget
        self.max_tokens = int(max_tokens)
        self.policy = policy or AdmissionPolicy()
        self.stats = stats or LengthStats()
        self.open: set[Reservation] = set()
        self.held = 0.0
        self.held_var = 0.0
        self.flags: dict[str, int] = {}
        self._refreshed = 0.0

    # -- what one more request would hold ----------------------------------------------------
    @property
    def learned(self) -> bool:
        return self.policy.kind == "expected" and self.stats.count >= self.policy.min_rows

    def _estimate_new(self) -> tuple[float, float]:
        """The finished replies are the short ones early in a run (long replies take longer), so the
        requests in flight count too, at what they are expected to hold: until the long ones have
        come back, a new request is expected to be long."""
        if not self.learned:
            return float(self.max_tokens), 0.0
        mean, var = self.stats.overall()
        n = self.stats.window
        mean = (mean * n + self.held) / (n + len(self.open))
        return min(mean, float(self.max_tokens)), var

    def _fits(self, est: float, var: float) -> bool:
        if self.policy.kind == "strict":
            return self.budget.used + self.held + self.max_tokens <= self.budget.limit
        if not self.learned:
            return self.budget.used + self.held + est <= self.budget.limit
        p = self.policy
        tail = min(self.stats.quantile(p.tail_quantile), float(self.max_tokens)) - est
        spread = max(p.z * math.sqrt(self.held_var + var), tail)
        return self.budget.used + self.held + est + spread <= self.budget.limit * (1.0 + p.tolerance)

    def try_admit(self, now: float | None = None) -> Reservation | None:
        now = time.monotonic() if now is None else now
        self.refresh(now)
        est, var = self._estimate_new()
        if not self._fits(est, var):
            return None
        if self.policy.kind == "strict" and not self.budget.try_reserve(self.max_tokens):
            return None  # the ledger itself refuses (kept exact for strict)
        r = Reservation(self, now, est, var)
        self.open.add(r)
        self.held += est
        self.held_var += var
        if self.policy.kind != "strict":
            self._mirror()
        return r

    @property
    def in_flight(self) -> int:
        return len(self.open)

    @property
    def exhausted(self) -> bool:
        """Nothing in flight can free room, and not even one more request fits."""
        if self.open:
            return False
        est, var = self._estimate_new()
        return not self._fits(est, var)

    @property
    def projected_total(self) -> float:
        return self.budget.used + self.held

    # -- re-estimating what is in flight -------------------------------------------------------
    def refresh(self, now: float, force: bool = False) -> None:
        """Re-estimate every request in flight by its age (expected policy, at most every ``refresh_s``)."""
        if not self.learned or not self.open or (not force and now - self._refreshed < self.policy.refresh_s):
            return
        self._refreshed = now
        rs = list(self.open)
        ages = np.array([now - r.started for r in rs])
        mean, var, known = self.stats.given_ages(ages, self.policy.min_tail)
        cap = float(self.max_tokens)
        held = held_var = 0.0
        for r, m, v, k in zip(rs, mean.tolist(), var.tolist(), known.tolist()):
            r.tokens, r.var = (min(m, cap), v) if k else (cap, 0.0)
            held += r.tokens
            held_var += r.var
        self.held, self.held_var = held, held_var
        self._mirror()

    def _mirror(self) -> None:
        self.budget.reserved = int(math.ceil(self.held))

    # -- settling ---------------------------------------------------------------------------------
    def _close(self, r: Reservation, actual: int | None, charge: bool = True) -> None:
        r.open = False
        self.open.discard(r)
        if charge and actual is not None:  # what this dataset's replies look like, age included
            self.stats.add(time.monotonic() - r.started, actual)
        if self.policy.kind == "strict":
            self.held -= self.max_tokens
            if charge:
                tokens = self._charged(actual)
                if tokens > self.max_tokens:  # the server ignored max_tokens: charge what it produced
                    self.budget.reserved -= self.max_tokens
                    self.budget.used += tokens
                else:
                    self.budget.settle(self.max_tokens, tokens)
            else:
                self.budget.release(self.max_tokens)
        else:
            self.held = max(0.0, self.held - r.tokens)
            self.held_var = max(0.0, self.held_var - r.var)
            if not self.open:
                self.held = self.held_var = 0.0  # no float drift once nothing is in flight
            if charge:
                self.budget.used += self._charged(actual)
            self._mirror()

    def _charged(self, actual: int | None) -> int:
        if actual is None:  # no usage reported: charge the worst case
            self.flags["usage_missing"] = self.flags.get("usage_missing", 0) + 1
            return self.max_tokens
        if actual > self.max_tokens:
            self.flags["over_max_tokens"] = self.flags.get("over_max_tokens", 0) + 1
        return int(actual)
