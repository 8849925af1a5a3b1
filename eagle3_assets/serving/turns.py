"""MT-bench's later turns: turn ``j`` of a row is asked after the target's own replies to the turns
before it, so it is measured on the conversation a user of the target would have.

The replies are greedy, made once before the sweep by the target in this process (the generation
stage's embedded model), and cached in ``serving/turn_replies.json``. Every engine and setting then
serves the same static prompts, so the journal, reuse, provenance and the check against the
baseline's outputs hold for a later turn as for a first one. A row's replies are keyed by what they
depend on: its turns, its first prompt as the target renders it, the target's identity, the reply
length and the precision the model ran at; a changed key makes them again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from eagle3_assets.files import write_text_atomic
from eagle3_assets.serving.bench_prompts import TURN_MARK, BenchPrompt, BenchPromptError

REPLIES_FILE = "turn_replies.json"


@dataclass
class ReplyModel:
    """The target as it replies: ``load`` gives a model with ``generate(prompt ids, max_new_tokens=...)``
    (called only when a reply is not cached); ``precision`` names its device and dtype (in the key)."""

    load: Callable[[], object]
    precision: str


def conversation(prompt: BenchPrompt, replies: list[str], turn: int) -> list[dict]:
    """The messages of turn ``turn`` (from 1): each earlier user turn followed by the target's reply."""
    messages: list[dict] = []
    for i in range(turn - 1):
        messages += [{"role": "user", "content": prompt.turns[i]}, {"role": "assistant", "content": replies[i]}]
    return [*messages, {"role": "user", "content": prompt.turns[turn - 1]}]


def reply_key(prompt: BenchPrompt, first_ids: list[int], *, target_id: str, reply_tokens: int, precision: str) -> str:
    """The cache key of one row's replies (the first prompt's ids carry the chat template and its settings)."""
    what = {"turns": list(prompt.turns), "first_ids": list(first_ids), "target": target_id,
            "reply_tokens": reply_tokens, "precision": precision}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def _read(path: Path) -> dict:
    try:
        cached = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}  # none yet, or torn: made again
    return cached if isinstance(cached, dict) else {}


def _usable(entry, prompt: BenchPrompt) -> bool:
    """A cached entry holds a text and a finish reason for each turn but the last (else it is made again)."""
    if not isinstance(entry, dict):
        return False
    replies, finish = entry.get("replies"), entry.get("finish")
    return (isinstance(replies, list) and isinstance(finish, list) and len(replies) == len(finish) == len(prompt.turns) - 1
            and all(isinstance(r, str) for r in replies))


def _generate(model, tokenizer, rows: list[BenchPrompt], reply_tokens: int, batch_size: int) -> dict[str, dict]:
    """Each row's replies to all its turns but the last, turn by turn (a reply needs the one before)."""
    from eagle3_assets.generation.local import length_batches

    made = {p.prompt_id: {"replies": [], "finish": []} for p in rows}
    for turn in range(1, max(len(p.turns) for p in rows)):
        asked = [p for p in rows if len(p.turns) > turn]
        ids = [tokenizer.render_prompt(conversation(p, made[p.prompt_id]["replies"], turn)) for p in asked]
        for group in length_batches([len(x) for x in ids], batch_size, max_new_tokens=reply_tokens):
            outs = model.generate([ids[i] for i in group], max_new_tokens=reply_tokens, temperature=0.0)
            for i, g in zip(group, outs):
                made[asked[i].prompt_id]["replies"].append(g.text)
                made[asked[i].prompt_id]["finish"].append(g.finish_reason)
    return made


def target_replies(prompts: list[BenchPrompt], tokenizer, model: ReplyModel, *, target_id: str, reply_tokens: int,
                   cache: Path, batch_size: int = 8, log: Callable[[str], None] = print) -> tuple[dict, dict]:
    """prompt id -> the target's replies to every turn of its row but the last, for the rows of more
    than one turn; and a report (rows, made, reused, replies cut at ``reply_tokens``)."""
    rows = [p for p in prompts if len(p.turns) > 1]
    keys = {p.prompt_id: reply_key(p, p.render(tokenizer), target_id=target_id, reply_tokens=reply_tokens,
                                   precision=model.precision) for p in rows}
    cached = _read(cache)
    have = {p.prompt_id: cached[keys[p.prompt_id]] for p in rows if _usable(cached.get(keys[p.prompt_id]), p)}
    todo = [p for p in rows if p.prompt_id not in have]
    if todo:
        log(f"the target's replies to {len(todo)} rows' earlier turns, up to {reply_tokens} tokens each")
        have.update(_generate(model.load(), tokenizer, todo, reply_tokens, batch_size))
        made = {keys[p.prompt_id]: {"prompt": p.prompt_id, **have[p.prompt_id]} for p in todo}
        write_text_atomic(cache, json.dumps({**cached, **made}, indent=1))
    cut = sum(f == "length" for pid in keys for f in have[pid]["finish"])
    report = {"rows": len(rows), "made": len(todo), "reused": len(rows) - len(todo), "reply_tokens": reply_tokens,
              "replies_cut": cut, "precision": model.precision}
    return {pid: have[pid]["replies"] for pid in keys}, report


def with_later_turns(prompts: list[BenchPrompt], replies: dict[str, list[str]]) -> list[BenchPrompt]:
    """The prompts with each row's later turns after it, as ``<id>/turn<j>`` of the same category."""
    taken = {p.prompt_id for p in prompts}
    out = []
    for p in prompts:
        out.append(p)
        for turn in range(2, len(p.turns) + 1):
            pid = f"{p.prompt_id}{TURN_MARK}{turn}"
            if pid in taken:
                raise BenchPromptError(f"{p.source}: prompt id {pid!r} is taken; it names turn {turn} of question "
                                       f"{p.prompt_id!r}")
            out.append(replace(p, prompt_id=pid, messages=tuple(conversation(p, replies[p.prompt_id], turn)), turns=()))
    return out
