"""Generate the missing samples of a dataset with the embedded model.

Resumable by sample id: samples already present in any source are skipped. Each batch is
admitted against the token budget (``max_new_tokens`` reserved per sample), generated, and
appended as whole lines before the next batch starts, so a crash loses at most the batch
in flight and never duplicates a finished sample.

Batches are formed by length (:func:`length_batches`): prompts are sorted, and a batch closes
before a prompt whose left padding would waste more than a quarter of the batch's compute, so
one 40k-token prompt runs alone instead of padding fifteen short ones to 40k tokens.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from eagle3_assets.engines.http.samples import SampleRequest, SamplingSettings
from eagle3_assets.engines.http.tool_flags import tool_flags
from eagle3_assets.engines.http.wire import now_iso
from eagle3_assets.generation.budget import TokenBudget
from eagle3_assets.generation.response_store import ResponseStore

SOURCE = "local"
MAX_PADDING = 0.25  # padded positions allowed, as a share of the batch's prompt + new-token positions
MAX_BATCH_TOKENS = 65_536  # rows x (longest prompt + max_new_tokens); a longer single prompt runs alone


def length_batches(lengths: list[int], batch_size: int, *, max_new_tokens: int = 0,
                   max_padding: float = MAX_PADDING, max_batch_tokens: int = MAX_BATCH_TOKENS) -> list[list[int]]:
    """Indices into ``lengths`` grouped into batches of similar length, shortest first.

    A batch holds at most ``batch_size`` prompts; it closes before a prompt that would make the
    left padding exceed ``max_padding`` of the positions the batch computes (every row runs to the
    longest prompt plus ``max_new_tokens``), or make those positions exceed ``max_batch_tokens``.
    """
    batches: list[list[int]] = []
    batch: list[int] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        n = lengths[i]
        if batch:
            rows = len(batch) + 1
            positions = rows * (n + max_new_tokens)  # sorted: the new prompt is the longest
            padding = rows * n - (real + n)
            if rows > batch_size or padding > max_padding * positions or positions > max_batch_tokens:
                batches.append(batch)
                batch, real = [], 0
        batch.append(i)
        real += n
    if batch:
        batches.append(batch)
    return batches


@dataclass
class GenerationReport:
    planned: int
    already_done: int
    new: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    seconds: float = 0.0
    finish_reasons: Counter = field(default_factory=Counter)
    flags: Counter = field(default_factory=Counter)  # e.g. tools_sent, tools_unused (as the HTTP report)
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
    rendered = [(r, r.render(model.render_prompt)) for r in todo]
    batches = length_batches([len(ids) for _, ids in rendered], batch_size, max_new_tokens=max_new_tokens)
    start = time.perf_counter()
    started = 0  # samples handed to the model so far
    with store.writer(SOURCE) as writer:
        for indices in batches:
            batch = []
            for k in indices:
                if not budget.try_reserve(max_new_tokens):
                    break
                batch.append(rendered[k])
            if batch:
                _generate_batch(model, batch, writer, settings, budget, report, max_new_tokens=max_new_tokens,
                                seed=settings.seed + started)
                started += len(batch)
                report.seconds = time.perf_counter() - start
                if progress:
                    progress(report, len(todo))
            if len(batch) < len(indices):
                report.left_by_budget = len(rendered) - started
                break
    report.seconds = time.perf_counter() - start
    return report


def _generate_batch(model, batch, writer, settings: SamplingSettings, budget: TokenBudget, report: GenerationReport,
                    *, max_new_tokens: int, seed: int) -> None:
    t0 = time.perf_counter()
    outs = model.generate(
        [ids for _, ids in batch], max_new_tokens=max_new_tokens,
        temperature=settings.temperature, top_p=settings.top_p, seed=seed,
    )
    latency = time.perf_counter() - t0
    rows = []
    parse = getattr(getattr(model, "target_tokenizer", None), "parse_tool_calls", None)
    for (req, prompt_ids), gen in zip(batch, outs):
        budget.settle(max_new_tokens, len(gen.output_ids))
        calls = parse(gen.output_ids) if parse else None
        rows.append({
            "sample_id": req.sample_id, "dataset": req.dataset, "prompt_id": req.prompt_id,
            "sample_index": req.sample_index, "source": SOURCE, "model": model.name,
            "provider": "embedded", "prompt_ids": prompt_ids, "output_ids": gen.output_ids,
            "text": gen.text, "reasoning": None, "tool_calls": calls, "finish_reason": gen.finish_reason,
            "prompt_tokens": len(prompt_ids), "completion_tokens": len(gen.output_ids),
            "cost_usd": 0.0, "latency_s": round(latency, 4), "attempts": 1, "created_at": now_iso(),
            "flags": tool_flags(req, calls),
        })
        report.finish_reasons[gen.finish_reason] += 1
        report.flags.update(rows[-1]["flags"])
        report.completion_tokens += len(gen.output_ids)
        report.prompt_tokens += len(prompt_ids)
    writer.write_batch(rows)
    report.new += len(rows)
