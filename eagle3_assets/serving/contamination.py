"""A benchmark prompt that is also in the recipe's training data measures nothing: find them.

The comparison is on token ids: each benchmark prompt as the target renders it, and each of its user
turns asked alone, against the prompt part (``input_ids[:prompt_len]``) of every training row of the
recipe's merged corpora. A later turn of a conversation is a question of its own: a training row that
asks it alone (or asks the first turn) makes the whole conversation's figure say nothing.
"""

from __future__ import annotations


def training_prompts(layout, datasets) -> dict[tuple[int, ...], str]:
    """Prompt ids of the train split of each dataset -> the dataset holding it."""
    import polars as pl

    seen: dict[tuple[int, ...], str] = {}
    for name in datasets:
        path = layout.corpus(name)
        if not path.exists():
            continue
        corpus = pl.read_parquet(path, columns=["input_ids", "prompt_len", "split"]).filter(pl.col("split") == "train")
        for ids, n in zip(corpus["input_ids"].to_list(), corpus["prompt_len"].to_list()):
            seen.setdefault(tuple(ids[:n]), name)
    return seen


def _candidates(prompt, ids: list[int], tokenizer):
    """(which, ids): the prompt as served, then each user turn alone (turn counted from 1)."""
    yield "prompt", tuple(ids)
    if tokenizer is None:
        return
    users = [m.get("content") for m in prompt.messages if m.get("role") == "user"]
    for turn, text in enumerate(users, start=1):
        if isinstance(text, str) and text:
            yield f"user turn {turn}", tuple(tokenizer.render_prompt([{"role": "user", "content": text}]))


def contaminated(prompts, rendered: list[list[int]], train: dict[tuple[int, ...], str], tokenizer=None) -> list[dict]:
    """The benchmark prompts found in the training prompts, naming each, what matched and the dataset
    (``tokenizer``: the target's, to ask each user turn alone; without it only whole prompts)."""
    found: list[dict] = []
    if not train:
        return found
    for p, ids in zip(prompts, rendered):
        hit = next(((which, train[c]) for which, c in _candidates(p, ids, tokenizer) if c in train), None)
        if hit:
            found.append({"prompt": p.prompt_id, "category": p.category, "source": p.source, "match": hit[0],
                          "training_dataset": hit[1]})
    return found
