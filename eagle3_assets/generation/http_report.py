"""What an HTTP generation run reports: per dataset, for the whole run, and while it runs.

Dollars come in three kinds, never mixed: ``cost_usd`` (the ``usage.cost`` of the rows kept),
``cost_usd_failed`` (billed on attempts that left no row: retried or failed replies that still
carried a cost) and ``billed_unseen_usd`` (what the provider's key usage grew by beyond every
cost the client saw, e.g. replies lost to a dropped connection after billing; shared among the
datasets by their attempts that ended without a reply). ``billed_usd`` is their sum.
``billed_to_dead_runs_usd`` is apart: what earlier runs that died were billed beyond what they
saw (found at this run's start, :mod:`key_ledger`), this dataset's share.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

OK_STOPS = (None, "budget", "max_new_samples")


class RunStopped(RuntimeError):
    """Raised by :func:`raise_for_stop` for a run that stopped on 401 / credits / key limit."""


class _Rates:
    """Rows and tokens per second over ``elapsed_s`` (a report or a progress snapshot)."""

    new: int
    completion_tokens: int
    elapsed_s: float

    @property
    def rows_per_s(self) -> float:
        return self.new / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass
class HttpGenerationReport(_Rates):
    """One dataset's figures (``dataset`` set) or a whole run's (``lanes`` holds each dataset's)."""

    source: str
    planned: int = 0
    already_done: int = 0
    todo: int = 0
    concurrency: int = 0
    dataset: str | None = None
    new: int = 0
    errors: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    reasoning_tokens: int = 0
    cost_usd: float = 0.0  # sum of usage.cost of the new rows
    cost_usd_failed: float = 0.0  # billed on attempts that did not produce a row (seen by the client)
    billed_unseen_usd: float = 0.0  # key usage growth beyond every cost seen, apportioned
    billed_to_dead_runs_usd: float = 0.0  # earlier runs that died: their unseen spend, this dataset's share
    attempts: int = 0  # HTTP requests sent
    lost_attempts: int = 0  # attempts that ended with no reply at all (timeouts, dropped connections)
    retries: Counter = field(default_factory=Counter)  # by reason
    errors_by_reason: Counter = field(default_factory=Counter)
    prompts_missing_reasoning: list = field(default_factory=list)  # prompt ids refused for history reasoning
    finish_reasons: Counter = field(default_factory=Counter)
    flags: Counter = field(default_factory=Counter)  # e.g. prefix_repaired, prompt_tokens_mismatch
    left_by_budget: int = 0
    left_unstarted: int = 0  # not admitted because the run stopped (or max_new_samples)
    abandoned: int = 0  # admitted, then dropped unfinished when the run stopped (no row, no error)
    stopped_reason: str | None = None  # None (finished), cancelled, budget, unauthorized, credits, ...
    fatal: str | None = None  # redacted message of the reply that stopped the run
    elapsed_s: float = 0.0
    in_flight_peak: int = 0
    in_flight_mean: float = 0.0  # time-weighted, while work was waiting to be admitted
    full_gate_share: float = 0.0  # share of that time with at least 95% of the gate held by admitted samples
    budget_policy: str = "expected"
    budget_limit: int = 0
    budget_used: int = 0
    budget_remaining: int = 0
    clients: int = 0
    client: dict = field(default_factory=dict)  # the client process: how late its event loop ran (loop_lag)
    backend_info: dict = field(default_factory=dict)
    lanes: dict = field(default_factory=dict)  # dataset -> HttpGenerationReport (run reports only)

    @property
    def ok(self) -> bool:
        return self.stopped_reason in OK_STOPS

    @property
    def billed_usd(self) -> float:
        return self.cost_usd + self.cost_usd_failed + self.billed_unseen_usd

    @property
    def budget_overshoot(self) -> int:
        return max(0, self.budget_used - self.budget_limit)

    @property
    def unanswered(self) -> int:
        """Samples of this run left without a row: failed, left by the budget, or never started."""
        return self.todo - self.new

    @property
    def achieved_concurrency(self) -> float:
        """Mean requests in flight over the gate, while samples were waiting."""
        return self.in_flight_mean / self.concurrency if self.concurrency else 0.0

    def add_counts(self, other: HttpGenerationReport) -> None:
        """Sum another report's counters into this one (a run total from its datasets)."""
        for name in ("planned", "already_done", "todo", "new", "errors", "completion_tokens", "prompt_tokens",
                     "reasoning_tokens", "cost_usd", "cost_usd_failed", "billed_unseen_usd", "billed_to_dead_runs_usd",
                     "attempts", "lost_attempts", "left_by_budget", "left_unstarted", "abandoned", "budget_limit", "budget_used",
                     "budget_remaining"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("retries", "errors_by_reason", "finish_reasons", "flags"):
            getattr(self, name).update(getattr(other, name))
        self.prompts_missing_reasoning.extend(other.prompts_missing_reasoning)

    def summary(self) -> dict:
        """Flat, JSON-friendly figures (for Dagster metadata)."""
        out = {
            "source": self.source, "planned": self.planned, "already_done": self.already_done,
            "todo": self.todo, "new": self.new, "errors": self.errors, "unanswered": self.unanswered,
            "completion_tokens": self.completion_tokens, "prompt_tokens": self.prompt_tokens,
            "reasoning_tokens": self.reasoning_tokens, "cost_usd": self.cost_usd,
            "cost_usd_failed": self.cost_usd_failed, "billed_unseen_usd": self.billed_unseen_usd,
            "billed_usd": self.billed_usd, "billed_to_dead_runs_usd": self.billed_to_dead_runs_usd,
            "attempts": self.attempts, "lost_attempts": self.lost_attempts,
            "retries": dict(self.retries), "errors_by_reason": dict(self.errors_by_reason),
            "finish_reasons": dict(self.finish_reasons), "flags": dict(self.flags),
            "left_by_budget": self.left_by_budget, "left_unstarted": self.left_unstarted, "abandoned": self.abandoned,
            "stopped_reason": self.stopped_reason, "fatal": self.fatal,
            "elapsed_s": round(self.elapsed_s, 3), "rows_per_s": round(self.rows_per_s, 3),
            "tokens_per_s": round(self.tokens_per_s, 1), "concurrency": self.concurrency,
            "in_flight_peak": self.in_flight_peak, "in_flight_mean": round(self.in_flight_mean, 1),
            "achieved_concurrency": round(self.achieved_concurrency, 4),
            "full_gate_share": round(self.full_gate_share, 4), "clients": self.clients, **self.client,
            "budget_policy": self.budget_policy, "budget_limit": self.budget_limit, "budget_used": self.budget_used,
            "budget_remaining": self.budget_remaining, "budget_overshoot": self.budget_overshoot,
            "backend_info": self.backend_info,
        }
        if self.prompts_missing_reasoning:  # the prompt file's problem: these rows need their reasoning
            ids = sorted(set(self.prompts_missing_reasoning))
            out["prompt_file_problem"] = (
                f"{len(ids)} prompt(s) refused by the backend because an assistant tool-call turn in their history "
                "has no reasoning (thinking is on): give those turns reasoning_content (or reasoning), or turn "
                f"thinking off; prompt ids: {', '.join(ids[:20])}" + (" ..." if len(ids) > 20 else ""))
        if self.dataset is not None:
            out["dataset"] = self.dataset
        return out


def raise_for_stop(report: HttpGenerationReport) -> HttpGenerationReport:
    if not report.ok and report.stopped_reason != "cancelled":
        raise RunStopped(f"{report.source} run stopped: {report.stopped_reason}: {report.fatal or ''}".strip())
    return report


@dataclass
class Progress(_Rates):
    """A snapshot for the log line every few seconds; after a stop it says what happened instead
    of projecting."""

    new: int
    errors: int
    todo: int
    in_flight: int
    retries: int
    completion_tokens: int
    cost_usd: float
    elapsed_s: float
    expected_rows: int | None = None  # rows the run should end with, budgets considered
    stopped: str | None = None  # why admissions closed: budget, cancelled, credits, ...
    datasets: int = 1
    datasets_done: int = 0
    finished: bool = False  # the run is over

    @property
    def target(self) -> int:
        return self.todo if self.expected_rows is None else min(self.todo, self.expected_rows)

    @property
    def eta_s(self) -> float | None:
        left = self.target - self.new - self.errors
        rate = (self.new + self.errors) / self.elapsed_s if self.elapsed_s > 0 else 0.0
        return max(0.0, left) / rate if rate > 0 else None

    @property
    def projected_cost_usd(self) -> float | None:
        """Estimate: dollars so far scaled to the rows this run should end with."""
        return self.cost_usd / self.new * self.target if self.new and self.stopped is None else None

    def line(self) -> str:
        sets = f" over {self.datasets} datasets ({self.datasets_done} done)" if self.datasets > 1 else ""
        head = (f"{self.new}/{self.todo} rows{sets}, {self.errors} errors, {self.in_flight} in flight, "
                f"{self.rows_per_s:.2f} rows/s, {self.completion_tokens:,} tokens ({self.tokens_per_s:.0f}/s), "
                f"${self.cost_usd:.4f}")
        if self.stopped is not None:
            left = self.todo - self.new - self.errors
            what = {"budget": "the token budget is spent"}.get(self.stopped, self.stopped)
            return f"{head}, {self.retries} retries; admissions closed: {what}; {left} samples not generated"
        if self.finished:
            return f"{head}, {self.retries} retries; finished in {self.elapsed_s:.0f}s"
        eta = f"{self.eta_s:.0f}s" if self.eta_s is not None else "?"
        proj = f" (est. ${self.projected_cost_usd:.4f} for the run)" if self.projected_cost_usd is not None else ""
        return f"{head}{proj}, {self.retries} retries, ETA {eta}"
