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
from eagle3_assets.prompts.tools import declare_in_system_turn, has_tool_content, tool_figures
from eagle3_assets.target.tool_calls import KimiFormat, kimi_history_ids

CHUNK_ROWS = 1024
TOO_LONG = "too long for the target's context"
TEMPLATE_REFUSED = "refused by the chat template"
NO_TOOL_TEMPLATE = "tools the target's chat template cannot render"


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
    rows_with_tools: int = 0  # prompts that declare tools
    rows_with_tool_calls: int = 0  # prompts whose history holds calls
    tool_calls: int = 0
    max_tool_calls: int = 0  # in one prompt
    tool_results: int = 0  # tool-result turns
    tools_in_system_turn: int = 0  # prompts whose tools were written into the system turn (opted in)
    history_ids_rebuilt: int = 0  # history call ids rewritten in the target's own form (Kimi)

    def count_tools(self, prompt: Prompt) -> None:
        f = tool_figures(prompt.messages, prompt.tools)
        self.rows_with_tools += f["tools"] > 0
        self.rows_with_tool_calls += f["tool_calls"] > 0
        self.tool_calls += f["tool_calls"]
        self.max_tool_calls = max(self.max_tool_calls, f["tool_calls"])
        self.tool_results += f["tool_results"]

    def tool_figures(self) -> dict:
        """The ``prompts`` metadata about tools."""
        return {"rows_with_tools": self.rows_with_tools, "rows_with_tool_calls": self.rows_with_tool_calls,
                "tool_calls": self.tool_calls, "tool_calls_per_row_mean": round(self.tool_calls / self.written, 3)
                if self.written else 0.0, "tool_calls_per_row_max": self.max_tool_calls,
                "tool_result_turns": self.tool_results, "tools_in_system_turn": self.tools_in_system_turn,
                "history_call_ids_rebuilt": self.history_ids_rebuilt}

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
                       tools_in_system_turn: bool = False, chunk_rows: int = CHUNK_ROWS,
                       progress: Callable[[BuildReport], None] | None = None) -> BuildReport:
    """Write ``out`` from ``reader``'s file; raises the reader's summary when the file is refused.

    Tools are never dropped: for a target whose chat template renders none (SmolLM2), a row with
    tools or tool turns is refused, or, with ``tools_in_system_turn``, rewritten with the
    declarations in its system turn (:func:`declare_in_system_turn`)."""
    report, start = BuildReport(), time.perf_counter()
    max_tokens = limit.max_prompt_tokens
    with PromptTableWriter(out) as writer:
        for chunk in _chunks(iter(reader), chunk_rows):
            keep = []
            chunk = _fit_tools(reader, tok, chunk, tools_in_system_turn, report)
            for prompt, n in zip(chunk, rendered_lengths(tok, [p.messages for p in chunk], [p.tools for p in chunk])):
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
            for prompt in keep:
                report.count_tools(prompt)
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


def _fit_tools(reader: PromptReader, tok, chunk: list[Prompt], in_system_turn: bool, report: BuildReport) -> list[Prompt]:
    """The chunk as the target can render it: unchanged when its template renders tools, but for
    a Kimi target's history call ids, which are written in its own form."""
    if tok.supports_tools or not any(has_tool_content(p.messages, p.tools) for p in chunk):
        if KimiFormat.of(tok) is not None:
            for p in chunk:
                p.messages, n = kimi_history_ids(p.messages)
                report.history_ids_rebuilt += n
        return chunk
    out = []
    for p in chunk:
        if not has_tool_content(p.messages, p.tools):
            out.append(p)
        elif in_system_turn:
            p.messages, p.tools = declare_in_system_turn(p.messages, p.tools), None
            report.tools_in_system_turn += 1
            out.append(p)
        else:
            reader.reject(p, "tools" if p.tools else "(prompt)", f"the row has tools or tool turns, but the chat "
                          f"template of {tok.name} renders no tools and would drop them; set tools_in_system_turn: "
                          "true (add-dataset --tools-in-system-turn) to write them into the system turn", NO_TOOL_TEMPLATE)
    return out


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
