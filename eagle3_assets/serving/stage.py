"""The stage without Dagster: gather the prompts, check them against the training data, run the
sweep, and write what a user takes away.

Under ``drafters/<recipe>/``: ``serving/journal.jsonl`` (every cell measured, the cache),
``serving/result.json`` (the table, mismatches, contamination, engines skipped or missing) and
``serving.json`` next to the exports: the best setting per engine and concurrency with its serve
command and provenance, which ``eagle3 export`` prints.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eagle3_assets.serving.bench_prompts import (
    CATEGORIES,
    bundled_prompts,
    heldout_prompts,
    prompt_set_hash,
    read_bench_file,
    take_per_category,
)
from eagle3_assets.serving.journal import Journal
from eagle3_assets.serving.provenance import machine
from eagle3_assets.serving.results import best_settings, mismatches, rows
from eagle3_assets.serving.sweep import Bench, SweepSpec, run_sweep
from eagle3_assets.serving.turns import REPLIES_FILE, ReplyModel, target_replies, with_later_turns

BEST_FILE = "serving.json"


@dataclass
class PromptChoice:
    bundled: bool = True
    files: list[str] = field(default_factory=list)  # MT-bench, SPEED-Bench or project-format files
    per_category: int = 2  # rows of each category (0: all); a row of k turns is k prompts
    heldout_per_dataset: int = 2  # of each recipe dataset's held-out split (0: none)
    extra_categories: list[str] = field(default_factory=list)
    turn_reply_tokens: int = 512  # the target's reply to an earlier turn of a multi-turn row, at most


def gather_prompts(choice: PromptChoice, layout, datasets) -> list:
    known = (*CATEGORIES, *choice.extra_categories)
    prompts = list(bundled_prompts()) if choice.bundled else []
    for f in choice.files:
        prompts += read_bench_file(f, known)
    prompts = take_per_category(prompts, choice.per_category)
    if choice.heldout_per_dataset > 0:
        prompts += heldout_prompts(layout, datasets, choice.heldout_per_dataset)
    if not prompts:
        raise ValueError("no benchmark prompts: keep the bundled set, name a file, or take held-out prompts")
    return prompts


def serving_dir(layout, recipe: str) -> Path:
    return layout.drafter_dir(recipe) / "serving"


def embedded_replies(target) -> ReplyModel:
    """The target in this process on the CPU in float32, where no resource says otherwise."""
    from eagle3_assets.target.embedded import EmbeddedModel

    return ReplyModel(lambda: EmbeddedModel(target.model_dir, tokenizer=target.load_tokenizer()), "cpu float32")


def benchmark(layout, recipe, target, sweep: SweepSpec, choice: PromptChoice, *, roles: dict | None = None,
              replies: ReplyModel | None = None, log: Callable[[str], None] = print) -> dict:
    """Run (or reuse) the recipe's serving benchmark; returns what ``result.json`` holds. ``replies``:
    the target that answers a multi-turn row's earlier turns (default :func:`embedded_replies`)."""
    from eagle3_assets.serving.contamination import contaminated, training_prompts

    out_dir = serving_dir(layout, recipe.name)
    chosen = gather_prompts(choice, layout, list(recipe.datasets))
    tok = target.load_tokenizer()
    answers, turns = target_replies(chosen, tok, replies or embedded_replies(target), target_id=target.identity["id"],
                                    reply_tokens=choice.turn_reply_tokens, cache=out_dir / REPLIES_FILE, log=log)
    prompts = with_later_turns(chosen, answers)
    rendered = [p.render(tok) for p in prompts]
    dirty = contaminated(prompts, rendered, training_prompts(layout, list(recipe.datasets)), tok)
    bench = Bench(prompts, rendered, prompt_set_hash(prompts, rendered), Path(target.model_dir),
                  layout.drafter_dir(recipe.name), target.identity["id"], machine(), list(target.stop_token_ids()))
    outcome = run_sweep(bench, sweep, Journal(out_dir / "journal.jsonl"), roles=roles, log=log)
    table = rows(outcome.entries)
    best = best_settings(table)
    result = {"recipe": recipe.name, "bench_hash": bench.bench_hash, "machine": bench.machine,
              "prompts": [{"prompt": p.prompt_id, "category": p.category, "source": p.source, "tokens": len(ids)}
                          for p, ids in zip(prompts, rendered)],
              "sweep": asdict(sweep), "table": table, "mismatches": mismatches(outcome.entries), "contaminated": dirty,
              "missing": outcome.missing, "skipped": outcome.skipped, "notes": outcome.notes, "reused": outcome.reused,
              "turn_replies": turns, "measured": outcome.measured, "restarts": outcome.restarts, "wall_s": outcome.wall_s,
              "best": {e: {c: _best_entry(r, bench, recipe, roles, e) for c, r in per.items()} for e, per in best.items()}}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "result.json").write_text(json.dumps(result, indent=1))
    (layout.drafter_dir(recipe.name) / BEST_FILE).write_text(json.dumps(result["best"], indent=1))
    return result


def _best_entry(row: dict, bench: Bench, recipe, roles, engine: str) -> dict:
    from eagle3_assets.engines import engine_role

    role = (roles or {}).get(engine) or engine_role("serve", engine)
    command = role.user_command("<target>", bench.drafter_dir / engine, k=row["steps"], topk=row["topk"],
                                draft_tokens=row["draft_tokens"])
    return {"setting": row["setting"], "steps": row["steps"], "topk": row["topk"], "draft_tokens": row["draft_tokens"],
            "speedup": row["speedup"], "acceptance_length": row["acceptance_length"], "tokens_per_s": row["tokens_per_s"],
            "serve_command": command, "provenance": row["provenance"]}


def read_best(drafter_dir: Path | str) -> dict | None:
    path = Path(drafter_dir) / BEST_FILE
    return json.loads(path.read_text()) if path.exists() else None
