"""Benchmark prompts with categories: the bundled set, the user's files, the recipe's held-out split.

A user's file is JSONL (or Parquet) in one of three row shapes, told apart per row:
MT-bench's (``question_id``, ``category``, ``turns``), SPEED-Bench's (the same plus ``sub_category``,
``source``, ``multiturn``, ...) and the project's own prompt rows (``messages`` with tools, tool calls
and tool results, or ``conversations``) with a ``category``. A row of ``turns`` is read as its first
turn, keeping the later ones (``turns``): as in MT-bench, turn ``j`` is asked after the target's own
replies to the turns before it, which ``serving/turns.py`` generates once and adds as prompts of their
own. An unknown category or a malformed row raises one :class:`BenchPromptError` naming file, row
and field.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from eagle3_assets.errors import UserInputError

# the bundled set's categories, MT-bench's and SPEED-Bench's qualitative ones
CATEGORIES = ("chat", "writing", "roleplay", "coding", "math", "reasoning", "extraction", "summarization", "stem",
              "humanities", "multilingual", "qa", "rag", "multi-turn", "agentic", "long-input")
HELDOUT = "heldout:"  # the category of a recipe dataset's held-out split: heldout:<dataset>
BUNDLED = "serving_prompts.jsonl"
TURN_MARK = "/turn"  # a later turn's prompt id: <question_id>/turn<j>, j counted from 1


class BenchPromptError(UserInputError):
    """A benchmark file the stage cannot use; the message names file, row and field."""


@dataclass(frozen=True)
class BenchPrompt:
    prompt_id: str
    category: str
    source: str  # the file's name, or heldout:<dataset>
    messages: tuple = ()  # json-ready messages (tools kept structured), rendered by the target's template
    tools: tuple = ()
    ids: tuple[int, ...] = ()  # already token ids (a held-out prompt of the corpus)
    turns: tuple[str, ...] = ()  # every user turn of an MT-bench row (messages holds the first)

    def render(self, tokenizer) -> list[int]:
        if self.ids:
            return list(self.ids)
        return tokenizer.render_prompt([dict(m) for m in self.messages], tools=[dict(t) for t in self.tools] or None)


def _error(path, row: int, field: str, reason: str) -> BenchPromptError:
    return BenchPromptError(f"{path}: row {row}, field {field!r}: {reason}")


def _freeze(obj):
    return json.loads(json.dumps(obj))


def parse_bench_row(row: dict, number: int, path, known: tuple[str, ...] = CATEGORIES) -> BenchPrompt:
    """One row of a benchmark file in any of the three shapes, or :class:`BenchPromptError`."""
    from eagle3_assets.prompts.problems import RowError
    from eagle3_assets.prompts.rows import parse_row

    if not isinstance(row, dict):
        raise _error(path, number, "(row)", f"must be a JSON object, got {type(row).__name__}")
    category = row.get("category")
    if not isinstance(category, str) or not category:
        raise _error(path, number, "category", "missing: every benchmark prompt names its category")
    if category not in known:
        raise _error(path, number, "category", f"unknown category {category!r}; known: {', '.join(known)}")
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns:
            raise _error(path, number, "turns", "must be a non-empty list of non-empty strings")
        for i, t in enumerate(turns):
            if not isinstance(t, str) or not t.strip():
                raise _error(path, number, f"turns[{i}]", f"must be a non-empty string, got {t!r}"[:200])
        qid = row.get("question_id")
        if qid is None or isinstance(qid, bool) or str(qid) == "":
            raise _error(path, number, "question_id", "missing")
        return BenchPrompt(str(qid), category, Path(str(path)).name, ({"role": "user", "content": turns[0]},),
                           turns=tuple(turns))
    try:
        p = parse_row(row, number)
    except RowError as e:
        raise _error(path, number, e.field, e.reason) from None
    return BenchPrompt(p.prompt_id, category, Path(str(path)).name, tuple(_freeze(p.messages)),
                       tuple(_freeze(p.tools or [])))


def _rows(path: Path):
    if path.suffix == ".parquet":
        import polars as pl

        yield from enumerate(pl.read_parquet(path).to_dicts(), start=1)
        return
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as e:
            raise _error(path, number, "(row)", f"not valid JSON: {e.msg}") from None


def read_bench_file(path: Path | str, known: tuple[str, ...] = CATEGORIES) -> list[BenchPrompt]:
    path = Path(path)
    if not path.is_file():
        raise BenchPromptError(f"{path}: no such benchmark file")
    out, seen = [], {}
    for number, row in _rows(path):
        p = parse_bench_row(row, number, path, known)
        if p.prompt_id in seen:
            raise _error(path, number, "question_id" if "turns" in row else "id",
                         f"duplicate id {p.prompt_id!r} (first on row {seen[p.prompt_id]})")
        seen[p.prompt_id] = number
        out.append(p)
    if not out:
        raise BenchPromptError(f"{path}: no benchmark prompts")
    return out


def bundled_prompts() -> list[BenchPrompt]:
    """The project's own categorized set (``eagle3_assets/bundled/serving_prompts.jsonl``)."""
    with resources.as_file(resources.files("eagle3_assets").joinpath("bundled", BUNDLED)) as path:
        return read_bench_file(path)


def heldout_prompts(layout, datasets, per_dataset: int) -> list[BenchPrompt]:
    """Up to ``per_dataset`` prompts of each recipe dataset's held-out split, as ``heldout:<dataset>``."""
    from eagle3_assets.drafter.evaluate import eval_prompts

    out = []
    for name in datasets:
        for i, ids in enumerate(eval_prompts(layout, [name], per_dataset)):
            out.append(BenchPrompt(f"{name}-eval-{i}", HELDOUT + name, HELDOUT + name, ids=tuple(int(t) for t in ids)))
    return out


def take_per_category(prompts: list[BenchPrompt], limit: int) -> list[BenchPrompt]:
    """The first ``limit`` prompts of each category (0: all), in the order read."""
    counts: dict[str, int] = {}
    out = []
    for p in prompts:
        counts[p.category] = counts.get(p.category, 0) + 1
        if limit <= 0 or counts[p.category] <= limit:
            out.append(p)
    return out


def prompt_set_hash(prompts: list[BenchPrompt], rendered: list[list[int]]) -> str:
    """sha256 of the benchmark as served: every prompt's id, category and token ids."""
    h = hashlib.sha256()
    for p, ids in zip(prompts, rendered):
        h.update(json.dumps([p.prompt_id, p.category, p.source, ids], separators=(",", ":")).encode())
    return h.hexdigest()
