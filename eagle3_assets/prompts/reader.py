"""Reading a prompt file in one streaming pass: every row checked, every problem counted.

:class:`PromptReader` yields the usable prompts of a JSONL, JSONL.gz or Parquet file one at a
time and logs every bad row (file, line or row, field, reason) instead of stopping at the first.
After the pass, :meth:`PromptReader.finish` raises one :class:`PromptFileError` whose message
sums them all up, unless bad rows are to be skipped. Duplicate ids are bad rows too; only the
ids seen so far are kept in memory, never the rows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_assets.prompts.options import ReadOptions
from eagle3_assets.prompts.problems import ProblemLog, PromptFileError, RowError, RowProblem
from eagle3_assets.prompts.rows import Prompt, content_hash_id, parse_row
from eagle3_assets.prompts.sources import PromptSource
from eagle3_assets.prompts.turns import assistant_turn_prompts

__all__ = ["Prompt", "PromptFile", "PromptFileError", "PromptReader", "content_hash_id", "read_prompt_file"]


class PromptReader:
    """One pass over a prompt file. Iterate it for the prompts, then call :meth:`finish`."""

    def __init__(self, path: Path | str, options: ReadOptions | None = None, *, skip_invalid: bool | None = None):
        self.options = options or ReadOptions()
        self.skip_invalid = self.options.skip_invalid_rows if skip_invalid is None else skip_invalid
        self.source = PromptSource(path, self.options.columns)
        self.path = self.source.path
        self.log = ProblemLog(str(self.path))
        self.rows = 0  # records read, bad ones included (blank lines are not records)
        self.accepted = 0
        self.final_assistant_dropped = 0
        self.conversations = 0  # rows that gave at least one prompt
        self.prompts_per_conversation: Counter = Counter()  # prompts a conversation gave -> conversations
        self._seen: dict[str, int] = {}

    def __iter__(self) -> Iterator[Prompt]:
        drop = self.options.final_assistant == "drop"
        per_turn = self.options.prompt_per_assistant_turn
        for record in self.source.records():
            self.rows += 1
            if record.error is not None:
                self._log(record.number, record.error)
                continue
            try:
                prompt = parse_row(record.row, record.number, self.options.columns, drop_final_assistant=drop,
                                   keep_conversation=per_turn)
            except RowError as e:
                self._log(record.number, e)
                continue
            first = self._seen.setdefault(prompt.prompt_id, record.number)
            if first != record.number:
                self._log(record.number, RowError(self.options.columns.id, f"duplicate prompt id {prompt.prompt_id!r} "
                                                  f"(first seen on {self.source.unit} {first})", "duplicate id"))
                continue
            prompts = assistant_turn_prompts(prompt, prompt.conversation) if per_turn else [prompt]
            self.final_assistant_dropped += prompt.dropped_replies > 0 and not per_turn
            self.conversations += 1
            self.prompts_per_conversation[len(prompts)] += 1
            for p in prompts:
                p.conversation = None
                self.accepted += 1
                yield p

    def reject(self, prompt: Prompt, field_name: str, reason: str, kind: str) -> None:
        """A prompt found unusable after reading (e.g. too long for the target): one more bad row."""
        self.accepted -= 1
        self._log(prompt.line, RowError(field_name, reason, kind))

    def _log(self, number: int, e: RowError) -> None:
        self.log.add(RowProblem(str(self.path), self.source.unit, number, e.field, e.reason, e.kind))

    @property
    def skipped(self) -> int:
        return self.log.total

    def finish(self) -> None:
        """Raise the summary of every bad row (unless skipping them), or when nothing is usable."""
        if self.log and not self.skip_invalid:
            raise PromptFileError.from_log(self.log, self.rows)
        if self.accepted <= 0:
            detail = f"; {self.log.summary(self.rows, hint='')}" if self.log else ""
            raise PromptFileError(f"{self.path}: no usable prompt rows ({self.rows:,} read){detail}", self.log, self.rows)


@dataclass
class PromptFile:
    prompts: list[Prompt]
    skipped: list[RowProblem] = field(default_factory=list)  # the first few; ``skipped_count`` has them all
    rows: int = 0
    skipped_count: int = 0


def read_prompt_file(path: Path | str, *, options: ReadOptions | None = None, skip_invalid: bool | None = None) -> PromptFile:
    """The whole file in memory (small files, tests, benchmarks); raises the summary of bad rows."""
    reader = PromptReader(path, options, skip_invalid=skip_invalid)
    prompts = list(reader)
    reader.finish()
    return PromptFile(prompts, list(reader.log.examples), reader.rows, reader.skipped)
