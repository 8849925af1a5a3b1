"""One pass from a prompt file to the prompt table: read, measure, fit to the context, write.

Rows stream through in chunks: each chunk is parsed, measured with one batched tokenizer call,
checked against the target's context and appended to the table. Memory holds one chunk, the
ids seen so far and one int per prompt for the length figures. Bad rows of every kind (format,
duplicate id, chat template, context) end up in the reader's one summary; when it fails the
run, the previous table stays as it was.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from eagle3_assets.prompts.context import ContextLimit, OverContext, rendered_lengths, truncate_last_turn
from eagle3_assets.prompts.reader import PromptReader
from eagle3_assets.prompts.rows import Prompt
from eagle3_assets.prompts.table import PromptTableWriter

CHUNK_ROWS = 1024
TOO_LONG = "too long for the target's context"
TEMPLATE_REFUSED = "refused by the chat template"


@dataclass
class BuildReport:
    rows: int = 0  # records read
    written: int = 0
    over_context: int = 0  # prompts whose length + reserve exceeds the context (before any fix)
    truncated: int = 0
    skipped_over_context: int = 0  # left out by over_context: skip (or truncate that could not fit)
    bytes: int = 0
    seconds: float = 0.0
    lengths: array = field(default_factory=lambda: array("i"))  # every measured prompt, before truncation
    over_examples: list[dict] = field(default_factory=list)

    def length_figures(self) -> dict:
        if not self.lengths:
            return {}
        import numpy as np

        n = np.frombuffer(self.lengths, dtype=np.int32)  # no copy: 4 bytes a prompt at any scale
        p50, p95 = np.percentile(n, [50, 95], method="nearest")
        return {"p50": int(p50), "p95": int(p95), "max": int(n.max()), "mean": round(float(n.mean()), 1)}


def _chunks(prompts: Iterator[Prompt], size: int) -> Iterator[list[Prompt]]:
    while chunk := list(islice(prompts, size)):
        yield chunk


def build_prompt_table(reader: PromptReader, tok, limit: ContextLimit, over_context: OverContext, out: Path, *,
                       chunk_rows: int = CHUNK_ROWS, progress: Callable[[BuildReport], None] | None = None) -> BuildReport:
    """Write ``out`` from ``reader``'s file; raises the reader's summary when the file is refused."""
    report, start = BuildReport(), time.perf_counter()
    max_tokens = limit.max_prompt_tokens
    with PromptTableWriter(out) as writer:
        for chunk in _chunks(iter(reader), chunk_rows):
            keep = []
            for prompt, n in zip(chunk, rendered_lengths(tok, [p.messages for p in chunk])):
                if isinstance(n, str):
                    reader.reject(prompt, "(prompt)", n, TEMPLATE_REFUSED)
                    continue
                prompt.prompt_tokens = n
                report.lengths.append(n)
                if max_tokens is None or n <= max_tokens:
                    keep.append(prompt)
                    continue
                report.over_context += 1
                fitted = _fit(reader, tok, limit, over_context, prompt, report)
                if fitted is not None:
                    keep.append(fitted)
            if not reader.log or reader.skip_invalid:  # a file about to be refused is not written on
                writer.write(keep)
            report.rows = reader.rows
            if progress:
                progress(report)
        reader.finish()
        report.rows, report.written = reader.rows, writer.rows
        report.bytes = writer.commit()
    report.seconds = time.perf_counter() - start
    return report


def _fit(reader: PromptReader, tok, limit: ContextLimit, over_context: OverContext, prompt: Prompt,
         report: BuildReport) -> Prompt | None:
    n = prompt.prompt_tokens
    if over_context == "refuse":
        reader.reject(prompt, "(prompt)", limit.describe(n) + "; set over_context: skip or truncate in the prompts "
                      "config, or reserve fewer reply tokens (dataset_settings.context_reserve)", TOO_LONG)
        return None
    fitted = truncate_last_turn(tok, prompt, limit.max_prompt_tokens) if over_context == "truncate" else None
    if fitted is not None:
        report.truncated += 1
        outcome = f"truncated to {fitted.prompt_tokens:,}"
    else:
        report.skipped_over_context += 1
        outcome = "skipped" + (" (the other turns alone do not fit)" if over_context == "truncate" else "")
    if len(report.over_examples) < 10:
        report.over_examples.append({reader.source.unit: prompt.line, "prompt_id": prompt.prompt_id,
                                     "prompt_tokens": n, "outcome": outcome})
    return fitted
