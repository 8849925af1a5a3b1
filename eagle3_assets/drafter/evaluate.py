"""What the drafter asset needs around training: split sizes, held-out prompts, acceptance."""

from __future__ import annotations

from pathlib import Path

import polars as pl


def train_split_sizes(layout, datasets: dict[str, float], target) -> dict[str, int]:
    """Stored (not quarantined) training samples per dataset, after checking that every shard
    directory was extracted from ``target`` (a :class:`~eagle3_assets.target.spec.TargetSpec`)."""
    from eagle3_assets.hidden_states.reader import ShardReader

    sizes = {}
    for name in datasets:
        d = layout.hidden_states_dir(name)
        if not (d / "manifest.json").exists():
            raise FileNotFoundError(f"no hidden states for dataset {name!r} at {d}: materialize hidden_states[{name}] first")
        with ShardReader(d) as reader:
            target.check_recorded(reader.manifest.get("target"), f"hidden_states[{name}] ({d})")
            sizes[name] = len(reader.sample_ids("train"))
    return sizes


def eval_prompts(layout, datasets, limit: int) -> list[list[int]]:
    """Prompt ids of the held-out split, taken round-robin across the recipe's datasets, each
    prompt once (datasets with several replies per prompt, or built from the same prompt file,
    hold it many times). Each corpus is first checked against its table digest: an edited
    ``prompt_len`` would cut the prompts elsewhere, a relabelled ``split`` hold out other ones."""
    from eagle3_assets.tokens.digest import verify_table_digest

    per = []
    for name in datasets:
        table = verify_table_digest(layout.corpus(name))  # prompt_len and split as merged_corpus wrote them
        if not table.ok:
            raise ValueError(table.problem(layout.corpus(name), f"merged_corpus[{name}]"))
        corpus = pl.read_parquet(layout.corpus(name), columns=["input_ids", "prompt_len", "split"])
        ev = corpus.filter(pl.col("split") == "eval")
        per.append([ids[:n] for ids, n in zip(ev["input_ids"].to_list(), ev["prompt_len"].to_list())])
    out, seen = [], set()
    for i in range(max((len(p) for p in per), default=0)):
        for p in per:
            if i < len(p) and tuple(p[i]) not in seen:
                seen.add(tuple(p[i]))
                out.append(p[i])
    return out[:limit]


def load_export(out_dir: Path, embeddings):
    """The trained drafter rebuilt from the export the evaluator reads (``formats.evaluated_export_dir``)."""
    from eagle3_assets.drafter import formats

    export_dir = formats.evaluated_export_dir(out_dir)
    return formats.load(export_dir.name, export_dir, embeddings)


def evaluate_drafter(model_dir: Path, out_dir: Path, prompts: list[list[int]], recipe, stop_ids: list[int]) -> dict:
    """Acceptance of the exported drafter (loaded from its files alone, under ``out_dir``) and of
    an untrained one; decoding stops on ``stop_ids`` (the target's eos ids and end of turn:
    ``TargetSpec.stop_token_ids``)."""
    from eagle3_assets.drafter.formats import evaluated_export_dir
    from eagle3_assets.drafter.spec_decode import evaluate_acceptance, greedy_generate, untrained_baseline
    from eagle3_assets.drafter.target_weights import read_target_embeddings
    from eagle3_assets.target.loading import load_causal_lm

    target = load_causal_lm(model_dir)
    exports = checked_exports(out_dir, recipe)  # what the trainer wrote, checked before it is loaded
    drafter = load_export(out_dir, read_target_embeddings(model_dir)).float().eval()
    stop = list(stop_ids)
    ev = recipe.evaluation
    k, n = ev.speculative_k, ev.eval_max_new_tokens
    greedy = [greedy_generate(target, p, max_new_tokens=n, stop_ids=stop) for p in prompts]
    out = {}
    for name, model in (("trained", drafter), ("untrained", untrained_baseline(drafter, seed=recipe.training.seed + 1))):
        rep = evaluate_acceptance(target, model, prompts, k=k, max_new_tokens=n, stop_ids=stop, greedy_reference=greedy)
        out[name] = {"acceptance_length": rep.acceptance_length, "acceptance_length_no_bonus": rep.acceptance_length_no_bonus,
                     "per_position_rate": list(rep.per_position_rate), "verify_steps": rep.verify_steps,
                     "matches_greedy": bool(rep.matches_greedy), "near_ties": rep.near_ties}
    out.update(prompts=len(prompts), k=k, max_new_tokens=n, floor=ev.acceptance_floor, margin=ev.acceptance_margin,
               stop_ids=stop, evaluated=evaluated_export_dir(out_dir).name, exports=exports)
    return out


class ExportDigestError(ValueError):
    """An export is not the files the trainer wrote."""


def checked_exports(out_dir: Path, recipe) -> dict:
    """The fingerprints of every export of ``recipe`` under ``out_dir`` (what eval.json records),
    first checked against those the trainer recorded in ``result.json`` as it wrote them."""
    import json

    from eagle3_assets.drafter.export_fingerprint import fingerprint_problems, fingerprints

    out_dir, engines = Path(out_dir), recipe.shape.engines
    written = json.loads((out_dir / "result.json").read_text()).get("exports") if (out_dir / "result.json").exists() \
        else None
    if written is not None:
        problems = fingerprint_problems(written, out_dir, engines, by="result.json (the trainer, as it wrote them)",
                                        fix=f"re-materialize drafter_checkpoint[{recipe.name}]")
        if problems:
            raise ExportDigestError("; ".join(problems))
    return fingerprints(out_dir, engines)
