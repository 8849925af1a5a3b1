"""The sweep: speculative settings per engine (the baseline first) times concurrency levels.

A setting is what the engine takes on its command line: ``steps`` drafted per verification, ``topk``
branches per step (1: a chain) and ``draft_tokens`` verified per step (a chain verifies ``steps + 1``).
``steps == 0`` is the baseline, the target alone. An engine that cannot take a tree is planned with
its chains only, and the trees it was not given are reported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, order=True)
class Setting:
    steps: int = 0
    topk: int = 1
    draft_tokens: int = 0

    @property
    def baseline(self) -> bool:
        return self.steps == 0

    @property
    def label(self) -> str:
        if self.baseline:
            return "baseline"
        if self.topk == 1:
            return f"chain {self.steps}"
        return f"tree {self.steps}x{self.topk}/{self.draft_tokens}"

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, d: dict) -> Setting:
        return cls(int(d["steps"]), int(d.get("topk", 1)), int(d.get("draft_tokens", 0)))


BASELINE = Setting()


@dataclass(frozen=True)
class Cell:
    """One measurement: an engine serving one setting at one concurrency, over one category."""

    engine: str
    setting: Setting
    concurrency: int
    category: str

    @property
    def key(self) -> str:
        return f"{self.engine}|{self.setting.label}|c{self.concurrency}|{self.category}"


def chain(steps: int) -> Setting:
    if steps < 1:
        raise ValueError(f"a chain drafts at least one token per step, got {steps}")
    return Setting(steps, 1, steps + 1)


def tree(steps: int, topk: int, draft_tokens: int) -> Setting:
    if topk < 2 or draft_tokens < 2 or steps < 1:
        raise ValueError(f"a tree needs steps >= 1, topk >= 2 and draft_tokens >= 2, got {steps}, {topk}, {draft_tokens}")
    return Setting(steps, topk, draft_tokens)


def settings_for(chains: list[int], trees: list[tuple[int, int, int]], *, takes_trees: bool) -> tuple[list[Setting], list[str]]:
    """The baseline, then each chain, then each tree the engine takes; and a note per tree it does not."""
    out = [BASELINE] + [chain(k) for k in sorted(set(chains))]
    notes = []
    for t in trees:
        s = tree(*t)
        if takes_trees:
            out.append(s)
        else:
            notes.append(f"{s.label}: the engine drafts chains only")
    return out, notes


def plan_cells(engine: str, settings: list[Setting], concurrency: list[int], categories: list[str]) -> list[Cell]:
    """Every cell of one engine, grouped by setting (one server each), the baseline's first."""
    if not concurrency or any(c < 1 for c in concurrency):
        raise ValueError(f"concurrency levels must be >= 1, got {concurrency}")
    return [Cell(engine, s, c, cat) for s in settings for c in sorted(set(concurrency)) for cat in categories]
