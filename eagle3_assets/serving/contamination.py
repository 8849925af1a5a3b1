"""A benchmark prompt that is also in the recipe's training data measures nothing: find them.

The comparison is on token ids: each benchmark prompt as the target renders it against the prompt
part (``input_ids[:prompt_len]``) of every training row of the recipe's merged corpora.
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


def contaminated(prompts, rendered: list[list[int]], train: dict[tuple[int, ...], str]) -> list[dict]:
    """The benchmark prompts whose rendered ids are a training prompt, naming each and its dataset."""
    return [{"prompt": p.prompt_id, "category": p.category, "source": p.source, "training_dataset": train[tuple(ids)]}
            for p, ids in zip(prompts, rendered) if tuple(ids) in train]
