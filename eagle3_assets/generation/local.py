"""Generate the missing samples of a dataset with the embedded model.

Resumable by sample id: samples already present in any source are skipped. Each batch is
admitted against the token budget (``max_new_tokens`` reserved per sample), generated, and
appended as whole lines before the next batch starts, so a crash loses at most the batch
in flight and never duplicates a finished sample.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from eagle3_assets.generation.budget import TokenBudget
from eagle3_assets.generation.response_store import ResponseStore, now_iso
from eagle3_assets.generation.samples import SampleRequest, SamplingSettings

SOURCE = "local"


@dataclass
class GenerationReport:
    planned: int
    already_done: int
    new: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    seconds: float = 0.0
    finish_reasons: Counter = field(default_factory=Counter)
    left_by_budget: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0


def generate_local(
    model,
    requests: list[SampleRequest],
    store: ResponseStore,
    settings: SamplingSettings,
    budget: TokenBudget,
    *,
    max_new_tokens: int,
    batch_size: int = 16,
    progress: Callable[[GenerationReport, int], None] | None = None,
) -> GenerationReport:
    """Generate every request whose sample id is not on disk yet, within the budget."""
    done = store.finished_ids()
    todo = [r for r in requests if r.sample_id not in done]
    report = GenerationReport(planned=len(requests), already_done=len(requests) - len(todo))
    if not todo:
        return report
    rendered = [(r, model.render_prompt(r.messages)) for r in todo]
    rendered.sort(key=lambda x: len(x[1]))  # similar lengths batch with less padding
    start = time.perf_counter()
    with store.writer(SOURCE) as writer:
        for i in range(0, len(rendered), batch_size):
            batch = []
            for item in rendered[i : i + batch_size]:
                if not budget.try_reserve(max_new_tokens):
                    break
                batch.append(item)
            if not batch:
                report.left_by_budget = len(rendered) - i
                break
            t0 = time.perf_counter()
            outs = model.generate(
                [ids for _, ids in batch], max_new_tokens=max_new_tokens,
                temperature=settings.temperature, top_p=settings.top_p, seed=settings.seed + i,
            )
            latency = time.perf_counter() - t0
            rows = []
            for (req, prompt_ids), gen in zip(batch, outs):
                budget.settle(max_new_tokens, len(gen.output_ids))
                rows.append({
                    "sample_id": req.sample_id, "dataset": req.dataset, "prompt_id": req.prompt_id,
                    "sample_index": req.sample_index, "source": SOURCE, "model": model.name,
                    "provider": "embedded", "prompt_ids": prompt_ids, "output_ids": gen.output_ids,
                    "text": gen.text, "reasoning": None, "finish_reason": gen.finish_reason,
                    "prompt_tokens": len(prompt_ids), "completion_tokens": len(gen.output_ids),
                    "cost_usd": 0.0, "latency_s": round(latency, 4), "attempts": 1, "created_at": now_iso(),
                    "flags": [],
                })
                report.finish_reasons[gen.finish_reason] += 1
                report.completion_tokens += len(gen.output_ids)
                report.prompt_tokens += len(prompt_ids)
            writer.write_batch(rows)
            report.new += len(rows)
            report.seconds = time.perf_counter() - start
            if progress:
                progress(report, len(todo))
            if len(batch) < len(rendered[i : i + batch_size]):
                report.left_by_budget = len(rendered) - i - len(batch)
                break
    report.seconds = time.perf_counter() - start
    return report
