"""Bad prompt rows: each one named by file, line (or Parquet row) and field, all of a file summed up.

A file is read to its end even after a bad row, so one run reports every problem: a count per
kind and the first few rows in full. Only counts and a bounded number of examples are kept, so
a file with a million bad rows costs no more memory than one with ten.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from eagle3_assets.errors import UserInputError

EXAMPLES = 10  # rows quoted in full in a summary
FIX_HINT = ("Fix these rows, or skip them: `eagle3 add-dataset --skip-invalid`, or `skip_invalid_rows: true` "
            "in the prompts asset's config.")


class RowError(UserInputError):
    """One row's problem, raised while parsing it; the reader adds where it is."""

    def __init__(self, field: str, reason: str, kind: str):
        self.field, self.reason, self.kind = field, reason, kind
        super().__init__(f"field '{field}': {reason}")


@dataclass(frozen=True)
class RowProblem:
    path: str
    unit: str  # "line" for JSONL, "row" for Parquet (1-based)
    number: int
    field: str
    reason: str
    kind: str  # what the summary counts by

    @property
    def line(self) -> int:
        return self.number

    def where(self) -> str:
        return f"{self.unit} {self.number}, field '{self.field}': {self.reason}"

    def __str__(self) -> str:
        return f"{self.path}, {self.where()}"


class ProblemLog:
    """Counts per kind plus the first ``keep`` problems of one file."""

    def __init__(self, path: str, keep: int = EXAMPLES):
        self.path, self.keep = path, keep
        self.counts: Counter[str] = Counter()
        self.examples: list[RowProblem] = []

    def add(self, problem: RowProblem) -> None:
        self.counts[problem.kind] += 1
        if len(self.examples) < self.keep:
            self.examples.append(problem)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __bool__(self) -> bool:
        return self.total > 0

    def summary(self, rows: int, *, hint: str = FIX_HINT) -> str:
        """One text for the CLI, the asset's failure and the logs."""
        lines = [f"{self.path}: {self.total:,} of {rows:,} rows cannot be used", "by reason:"]
        width = len(f"{max(self.counts.values()):,}")
        lines += [f"  {n:>{width},}  {kind}" for kind, n in sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))]
        shown = f"all {self.total:,}" if len(self.examples) == self.total else f"the first {len(self.examples)}"
        lines.append(f"rows ({shown}):")
        lines += [f"  {p.where()}" for p in self.examples]
        if hint:
            lines.append(hint)
        return "\n".join(lines)

    def as_rows(self) -> list[dict]:
        """The examples as table rows, for metadata."""
        return [{p.unit: p.number, "field": p.field, "kind": p.kind, "reason": p.reason} for p in self.examples]


class PromptFileError(UserInputError):
    """A prompt file that cannot be used as it is: its message is the whole summary."""

    def __init__(self, message: str, log: ProblemLog | None = None, rows: int = 0):
        self.log, self.rows = log, rows
        super().__init__(message)

    @classmethod
    def from_log(cls, log: ProblemLog, rows: int) -> PromptFileError:
        return cls(log.summary(rows), log, rows)

    @property
    def problems(self) -> list[RowProblem]:
        return list(self.log.examples) if self.log else []

    @property
    def counts(self) -> dict[str, int]:
        return dict(self.log.counts) if self.log else {}
