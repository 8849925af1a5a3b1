"""``raw_responses`` without Dagster: prepare every selected dataset once, run them, summarize each.

One run serves every dataset the step was given (a single-run backfill hands it all of them):
each dataset's samples are planned once, its response files read once, ``max_samples`` applied
once; then either the embedded model generates them one dataset after another, or one HTTP engine
serves them all through one in-flight gate. Each dataset ends with its own summary (the figures of
its materialization) and ``last_run.json`` beside its responses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from eagle3_assets.engines.http.samples import SampleRequest, SamplingSettings, plan_samples
from eagle3_assets.errors import UserInputError
from eagle3_assets.generation.admission import AdmissionPolicy
from eagle3_assets.generation.budget import TokenBudget
from eagle3_assets.generation.http_report import HttpGenerationReport
from eagle3_assets.generation.lanes import DatasetJob
from eagle3_assets.generation.plan import DatasetState, RunPlan, plan_remaining
from eagle3_assets.generation.response_store import ResponseStore
from eagle3_assets.paths import DataLayout
from eagle3_assets.prompts.table import read_prompt_table


@dataclass
class PreparedDataset:
    dataset: str
    store: ResponseStore
    requests: list[SampleRequest]  # every sample the dataset should hold
    state: DatasetState  # what was on disk before the run
    todo: list[SampleRequest]  # what this run generates (max_samples applied)
    held_back: int  # left for a later run by max_samples
    budget: TokenBudget
    policy: AdmissionPolicy
    plan: RunPlan
    billed_before_usd: float  # billing.jsonl before the run (attempts that left no row)
    torn_bytes: int

    def job(self) -> DatasetJob:
        return DatasetJob(self.dataset, self.todo, self.store, self.budget, self.policy, self.state.length_stats(),
                          planned=len(self.requests), already_done=self.already_done, held_back=self.held_back)

    @property
    def already_done(self) -> int:
        return len(self.requests) - len(self.todo) - self.held_back


def prepare_dataset(layout: DataLayout, dataset: str, sampling: SamplingSettings, *, source: str, budget_tokens: int,
                    policy: AdmissionPolicy, max_tokens: int, max_samples: int = 0, prices=None,
                    context_length: int | None = None) -> PreparedDataset:
    """``context_length``: the target's; prompts still to answer that leave less than ``max_tokens``
    of it are refused here, before anything is generated or paid for."""
    store = ResponseStore(layout.responses_dir(dataset))
    torn = store.drop_torn_tail(source)
    prompts = read_prompt_table(layout.prompt_table(dataset))
    requests = plan_samples(dataset, prompts, sampling)
    state = DatasetState.read(store)
    todo, held_back = state.todo(requests, max_samples or None)
    if context_length:
        check_replies_fit(dataset, prompts, {r.prompt_id for r in todo}, max_tokens, context_length)
    plan = plan_remaining(requests, None, budget_tokens, max_tokens=max_tokens, prices=prices, state=state)
    billed = math.fsum(r.get("cost_usd") or 0.0 for r in store.billing())
    return PreparedDataset(dataset, store, requests, state, todo, held_back,
                           TokenBudget(budget_tokens, used=state.completion_tokens), policy, plan, billed, torn)


def check_replies_fit(dataset: str, prompts, todo_ids: set[str], max_tokens: int, context_length: int) -> None:
    """``prompts`` checked each prompt against the context with the reserve of its day; a run asking
    for longer replies than that reserve would overflow the context on the longest prompts (a
    server refuses them, a local model runs past its positions). Refuse the run instead."""
    over = [p for p in prompts if p.prompt_id in todo_ids and p.prompt_tokens is not None
            and p.prompt_tokens + max_tokens > context_length]
    if not over:
        return
    longest = max(p.prompt_tokens for p in over)
    rows = "; ".join(f"prompt file line {p.line}, id {p.prompt_id!r}: {p.prompt_tokens:,} tokens" for p in over[:3])
    what = "prompt leaves" if len(over) == 1 else "prompts leave"
    raise UserInputError(
        f"dataset {dataset!r}: {len(over):,} {what} less than max_new_tokens={max_tokens:,} of the target's context of "
        f"{context_length:,} tokens ({rows}{'; ...' if len(over) > 3 else ''}). Lower max_new_tokens to "
        f"{context_length - longest:,} or less, or re-materialize `prompts` with a context reserve of "
        f"{max_tokens:,} (dataset_settings.context_reserve or default_context_reserve) so that they are skipped or "
        "truncated there.")


def summarize(p: PreparedDataset, backend: str, rep) -> dict:
    """One dataset's figures after the run (plain values: metadata, ``last_run.json``, log lines).
    ``rep`` is the dataset's :class:`HttpGenerationReport` or the local generation report."""
    http = isinstance(rep, HttpGenerationReport)
    new = rep.new
    errors = rep.errors if http else 0
    cost_new = rep.cost_usd if http else 0.0
    billed_new = rep.billed_usd if http else 0.0
    dead = rep.billed_to_dead_runs_usd if http else 0.0
    total_tokens = p.state.completion_tokens + rep.completion_tokens
    left_by_budget = rep.left_by_budget
    left_unstarted = rep.left_unstarted if http else (p.held_back if not left_by_budget else 0)
    abandoned = rep.abandoned if http else 0
    stopped = rep.stopped_reason if http else ("budget" if left_by_budget else
                                               ("max_new_samples" if p.held_back else None))
    return {
        "dataset": p.dataset, "backend": backend, "stopped_reason": stopped,
        "new_responses": new, "new_completion_tokens": rep.completion_tokens, "errors": errors,
        "left_by_budget": left_by_budget, "left_unstarted": left_unstarted, "abandoned": abandoned,
        "unanswered": len(p.todo) + p.held_back - new,
        "skipped_already_done": p.already_done,
        "seconds": round(rep.elapsed_s if http else rep.seconds, 2),
        "tokens_per_s": round(rep.tokens_per_s, 2),
        "retries": dict(rep.retries) if http else {},
        "errors_by_reason": dict(rep.errors_by_reason) if http else {},
        "finish_reasons": dict(rep.finish_reasons),
        "flags": dict(rep.flags),
        "cost_usd_new": cost_new, "billed_usd_new": billed_new,
        "billed_unseen_usd_new": rep.billed_unseen_usd if http else 0.0,
        "billed_to_dead_runs_usd": dead,
        **(_dead_runs(p.dataset, rep) if dead else {}),
        "total_responses": p.state.rows + new,
        "total_completion_tokens": total_tokens,
        "total_cost_usd": p.state.cost_usd + cost_new,
        "total_billed_usd": p.state.cost_usd + p.billed_before_usd + billed_new + dead,
        "budget_policy": p.policy.kind, "budget_tokens": p.budget.limit, "budget_used": total_tokens,
        "budget_remaining": p.budget.limit - total_tokens,
        "budget_overshoot": max(0, total_tokens - p.budget.limit),
        "plan_before_run": {k: v for k, v in p.plan.summary().items() if not isinstance(v, dict)},
    }


def _dead_runs(dataset: str, rep) -> dict:
    """The runs that died on this dataset, reconciled at this run's start, and what the figure means."""
    from eagle3_assets.generation.key_ledger import CAVEAT

    runs = [{"run": d["run"], "how": d["how"], "share_usd": d["shares_usd"].get(dataset, 0.0), "gap_usd": d["gap_usd"],
             "datasets": len(d["datasets"])} for d in rep.backend_info.get("dead_runs", []) if dataset in d["shares_usd"]]
    return {"dead_runs": runs, "billed_to_dead_runs_note": CAVEAT}


def missing_line(s: dict) -> str | None:
    """A warning when samples of the dataset are still without a response, with why."""
    if not s["unanswered"]:
        return None
    parts = []
    if s["errors"]:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(s["errors_by_reason"].items()))
        parts.append(f"{s['errors']} failed ({reasons}; see errors.jsonl)")
    if s["left_by_budget"]:
        parts.append(f"{s['left_by_budget']} left by the token budget")
    if s["left_unstarted"]:
        why = s["stopped_reason"] or "not started"
        parts.append(f"{s['left_unstarted']} not started ({why})")
    if s["abandoned"]:
        parts.append(f"{s['abandoned']} dropped in flight when the run stopped")
    return f"{s['dataset']}: {s['unanswered']} samples still without a response: " + "; ".join(parts)
