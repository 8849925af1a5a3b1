"""One dataset inside a multi-dataset engine run: its queue, budget gate, files and report.

Every dataset keeps what a run of its own would have: its own budget (and policy), its own
response file, errors and billing files, its own resume and its own report. Only the in-flight
gate and the HTTP clients are shared.

The order of events for a kept reply is fixed: the row is handed to the operating system with one
``write`` (so a killed process cannot lose it) before its budget is settled, before it is counted,
before the worker takes its next sample.
"""

from __future__ import annotations

import math
from collections import deque
from contextlib import ExitStack
from dataclasses import dataclass, field

from eagle3_assets.engines.http.classify import MISSING_REASONING
from eagle3_assets.engines.http.samples import SampleRequest
from eagle3_assets.engines.http.wire import now_iso
from eagle3_assets.generation.admission import AdmissionPolicy, BudgetGate, LengthStats, Reservation
from eagle3_assets.generation.budget import TokenBudget
from eagle3_assets.generation.http_report import HttpGenerationReport
from eagle3_assets.generation.response_store import JsonlAppender, ResponseStore


@dataclass
class DatasetJob:
    """One dataset's work for a run: the samples still to do (already filtered against disk)."""

    dataset: str
    requests: list[SampleRequest]
    store: ResponseStore
    budget: TokenBudget
    policy: AdmissionPolicy = field(default_factory=AdmissionPolicy)
    stats: LengthStats | None = None  # reply lengths on disk, for the expected policy
    planned: int | None = None  # samples the dataset should hold (default: len(requests))
    already_done: int = 0
    held_back: int = 0  # samples not in this run because of max_new_samples


class Lane:
    def __init__(self, job: DatasetJob, source: str, max_tokens: int, concurrency: int):
        self.job = job
        self.dataset = job.dataset
        self.pending: deque[SampleRequest] = deque(job.requests)
        self.gate = BudgetGate(job.budget, max_tokens, job.policy, job.stats)
        self.report = HttpGenerationReport(
            source, planned=job.planned if job.planned is not None else len(job.requests),
            already_done=job.already_done, todo=len(job.requests), concurrency=concurrency, dataset=job.dataset,
            budget_policy=job.policy.kind, budget_limit=job.budget.limit)
        self.source = source
        self.costs: list[float] = []
        self.failed_costs: list[float] = []
        self.answered = 0  # attempts that got a reply (any status): attempts - answered never got one
        self.exhausted = False  # the budget admits nothing more
        self._files = ExitStack()
        self.rows = self.errors = self.billing = None

    # -- files -----------------------------------------------------------------------------------
    def open(self) -> None:
        self.rows = self._files.enter_context(self.job.store.writer(self.source))
        self.errors = self._files.enter_context(JsonlAppender(self.job.store.errors_path))
        self.billing = self._files.enter_context(JsonlAppender(self.job.store.billing_path))

    def sync(self) -> None:
        """fsync what was written since the last call (run on a worker thread)."""
        for f in (self.rows, self.errors, self.billing):
            if f is not None:
                f.sync()

    @property
    def dirty(self) -> bool:
        return any(f is not None and f.dirty for f in (self.rows, self.errors, self.billing))

    def close(self) -> None:
        self._files.close()

    # -- admission ---------------------------------------------------------------------------------
    @property
    def admitting(self) -> bool:
        return bool(self.pending) and not self.exhausted

    def try_admit(self, now: float) -> tuple[SampleRequest, Reservation] | None:
        """The next sample with its reservation, or None when the budget has no room right now
        (``exhausted`` is set when it never will)."""
        if not self.admitting:
            return None
        r = self.gate.try_admit(now)
        if r is None:
            if self.gate.exhausted:
                self.exhausted = True
            return None
        return self.pending.popleft(), r

    # -- outcomes (called by the worker that holds the sample) -------------------------------------
    def keep(self, row: dict, reservation: Reservation, flags=()) -> None:
        self.rows.write_row(row)  # first: in the operating system before anything else happens
        reservation.settle(row.get("completion_tokens"))
        r = self.report
        r.new += 1
        r.completion_tokens += row.get("completion_tokens") or 0
        r.prompt_tokens += row.get("prompt_tokens") or 0
        r.reasoning_tokens += row.get("reasoning_tokens") or 0
        if row.get("cost_usd"):
            self.costs.append(row["cost_usd"])
        r.finish_reasons[row.get("finish_reason")] += 1
        for flag in flags:
            r.flags[flag] += 1

    def fail(self, record: dict, reservation: Reservation) -> None:
        self.errors.append(record)
        reservation.release()
        self.report.errors += 1
        self.report.errors_by_reason[record["reason"]] += 1
        if record["reason"] == MISSING_REASONING:  # the rows to fix in the prompt file, named
            self.report.prompts_missing_reasoning.append(str(record.get("prompt_id")))

    def billed_without_row(self, req: SampleRequest, cost: float, reason: str, attempt: int) -> None:
        """A reply that cost money but left no row (retried, failed): recorded so the bill is whole."""
        self.failed_costs.append(cost)
        self.billing.append({"sample_id": req.sample_id, "prompt_id": req.prompt_id, "source": self.source,
                             "cost_usd": cost, "reason": reason, "attempt": attempt, "created_at": now_iso()})

    def record_unseen(self, usd: float, run_note: dict) -> None:
        """This dataset's share of dollars the provider billed but no reply showed."""
        self.report.billed_unseen_usd = usd
        if usd and self.billing is not None:
            self.billing.append({"sample_id": None, "source": self.source, "cost_usd": usd,
                                 "reason": "unseen_by_client", "created_at": now_iso(), **run_note})

    # -- the end -----------------------------------------------------------------------------------
    def finish(self, stopped_reason: str | None) -> None:
        r = self.report
        r.cost_usd = math.fsum(self.costs)
        r.cost_usd_failed = math.fsum(self.failed_costs)
        r.flags.update(self.gate.flags)
        left = len(self.pending)
        r.abandoned = r.todo - r.new - r.errors - left
        if stopped_reason is not None:
            r.left_unstarted = left + self.job.held_back
            r.stopped_reason = stopped_reason
        elif self.exhausted and left:
            r.stopped_reason, r.left_by_budget = "budget", left + self.job.held_back
        elif self.job.held_back:
            r.stopped_reason, r.left_unstarted = "max_new_samples", self.job.held_back
        b = self.job.budget
        r.budget_used, r.budget_remaining = b.used, b.limit - b.used - b.reserved
