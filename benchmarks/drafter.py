"""Drafter training and acceptance: train a recipe, then measure real speculative decoding.

Builds training features with the embedded target (greedy responses to the demo prompts, or
the rows of corpus Parquet files given with ``--corpus``), trains the recipe's drafter and
prints training tokens/s, the share of step time spent waiting for data (target <= 5%), and
the acceptance length (SGLang convention: accepted + 1 per verification) of the trained
drafter against an untrained one of the same shape on held-out prompts. Both decodings are
checked against plain greedy decoding of the target.

Run: ``.venv/bin/python benchmarks/drafter.py [--recipe demo] [--corpus data/corpus/general.parquet ...]``
"""

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from eagle3_assets.drafter.model import (  # noqa: E402
    DrafterConfig,
    build_drafter,
    read_target_config,
    read_target_embeddings,
    read_target_lm_head,
)
from eagle3_assets.drafter.recipes import load_recipe  # noqa: E402
from eagle3_assets.drafter.spec_decode import (  # noqa: E402
    evaluate_acceptance,
    greedy_generate,
    target_features,
    untrained_baseline,
)
from eagle3_assets.drafter.train import (  # noqa: E402
    FeatureBatches,
    Teacher,
    TrainConfig,
    add_target_ids,
    mix_datasets,
    train,
)
from eagle3_assets.drafter.vocab_map import build_vocab_map, count_tokens  # noqa: E402
from eagle3_assets.paths import BUNDLED, DataLayout  # noqa: E402
from eagle3_assets.prompts.reader import read_prompt_file  # noqa: E402
from eagle3_assets.target.embedded import EmbeddedModel, ensure_default_model  # noqa: E402


def generated_data(model: EmbeddedModel, datasets: list[str], per_dataset: int, eval_per_dataset: int,
                   max_new_tokens: int):
    """Greedy responses to the demo prompts: (train sequences by dataset, held-out prompts)."""
    train, held_out = {}, []
    for name in datasets:
        path = BUNDLED / "demo_prompts" / f"{name}.jsonl"
        prompts = [model.render_prompt(p.messages) for p in read_prompt_file(path).prompts]
        fit, rest = prompts[:per_dataset], prompts[per_dataset:]
        held_out += rest[:eval_per_dataset]
        gens = model.generate(fit, max_new_tokens=max_new_tokens)
        train[name] = [(p + g.output_ids, [0] * len(p) + [1] * len(g.output_ids)) for p, g in zip(fit, gens)]
    return train, held_out


def corpus_data(paths: list[Path]):
    """Rows of merged-corpus Parquet files: train split for training, eval-split prompts held out."""
    import polars as pl

    train, held_out = {}, []
    for path in paths:
        df = pl.read_parquet(path)
        for row in df.iter_rows(named=True):
            if row["split"] == "eval":
                held_out.append(list(row["input_ids"][: row["prompt_len"]]))
            else:
                train.setdefault(row.get("dataset") or path.stem, []).append(
                    (list(row["input_ids"]), list(row["loss_mask"])))
    return train, held_out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="demo")
    ap.add_argument("--corpus", type=Path, nargs="*", help="merged-corpus Parquet files (default: generate)")
    ap.add_argument("--per-dataset", type=int, default=16, help="generated training samples per dataset")
    ap.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts (default: the recipe's)")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="length of generated training responses")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core box)")
    ap.add_argument("--max-steps", type=int, default=None, help="override the recipe's length")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    recipe = load_recipe(args.recipe)
    model_dir = ensure_default_model(DataLayout.from_env().models_dir)
    target = EmbeddedModel(model_dir)
    n_eval = args.eval_prompts or recipe.eval_samples
    datasets = sorted(recipe.datasets)

    t0 = time.perf_counter()
    if args.corpus:
        seqs, held_out = corpus_data(args.corpus)
        source = f"corpus {', '.join(str(p) for p in args.corpus)}"
    else:
        seqs, held_out = generated_data(target, datasets, args.per_dataset,
                                        -(-n_eval // len(datasets)), args.max_new_tokens)
        source = f"{args.per_dataset} greedy responses per dataset ({', '.join(datasets)})"
    held_out = held_out[:n_eval]
    t_data = time.perf_counter() - t0

    target_cfg = read_target_config(model_dir)
    dcfg = DrafterConfig.from_target(target_cfg, draft_vocab_size=recipe.draft_vocab_size,
                                     aux_layer_ids=recipe.aux_layer_ids, intermediate_size=recipe.intermediate_size)
    t0 = time.perf_counter()
    feats = {name: target_features(target.model, [s for s, _ in rows], [m for _, m in rows], dcfg.aux_layer_ids)
             for name, rows in seqs.items()}
    t_feat = time.perf_counter() - t0
    samples = mix_datasets(feats, recipe.datasets, recipe.seed)
    counts = count_tokens(((s["input_ids"], s["loss_mask"]) for s in samples), dcfg.vocab_size)
    vmap = build_vocab_map(counts, dcfg.draft_vocab_size)
    teacher = Teacher(read_target_lm_head(model_dir).float(), vmap)
    t0 = time.perf_counter()
    samples = add_target_ids(samples, teacher)
    t_teacher = time.perf_counter() - t0
    data = FeatureBatches(samples, recipe.batch_size, seed=recipe.seed, max_length=recipe.max_length)
    overrides = {"progress": False, **({"max_steps": args.max_steps} if args.max_steps else {})}
    cfg = TrainConfig.from_recipe(recipe, steps_per_epoch=len(data), **overrides)
    drafter = build_drafter(dcfg, read_target_embeddings(model_dir), vmap, seed=recipe.seed)
    baseline = untrained_baseline(drafter, seed=recipe.seed)

    with tempfile.TemporaryDirectory() as out:
        result = train(cfg, drafter, data, teacher, Path(out))
    drafter.eval()

    k, n_new = recipe.speculative_k, recipe.eval_max_new_tokens
    t0 = time.perf_counter()
    greedy = [greedy_generate(target.model, p, max_new_tokens=n_new, stop_ids=target.stop_ids) for p in held_out]
    t_greedy = time.perf_counter() - t0
    reports = {}
    for name, d in (("trained", drafter), ("untrained", baseline)):
        t0 = time.perf_counter()
        rep = evaluate_acceptance(target.model, d, held_out, k=k, max_new_tokens=n_new, stop_ids=target.stop_ids,
                                  greedy_reference=greedy)
        reports[name] = (rep, time.perf_counter() - t0)

    tokens = sum(int(s["attention_mask"].sum()) if "attention_mask" in s else len(s["input_ids"]) for s in samples)
    f = result.final
    print(f"recipe {recipe.name}: {source}; torch threads {torch.get_num_threads()}")
    print(f"data: {len(samples)} training sequences, {tokens} tokens ({int(counts.sum())} supervised), "
          f"{len(held_out)} held-out prompts; generation/reading {t_data:.1f}s, features {t_feat:.1f}s, "
          f"teacher argmax {t_teacher:.1f}s")
    print(f"drafter: hidden {dcfg.hidden_size}, intermediate {dcfg.intermediate_size}, draft vocab "
          f"{dcfg.draft_vocab_size}, {sum(p.numel() for p in drafter.parameters() if p.requires_grad) / 1e6:.2f}M "
          f"trainable params; ttt_steps {cfg.ttt_steps}, batch {cfg.batch_size}, {cfg.max_steps} steps")
    print(f"training: {result.wall_s:.1f}s, {result.tokens_per_s:.0f} tokens/s, data-loading share "
          f"{100 * result.data_share:.2f}% of step time")
    print(f"loss {result.metrics[0]['loss']:.3f} -> {f['loss']:.3f}; final top-1 agreement per TTT step "
          + " ".join(f"{a:.2f}" for a in f["acc_per_step"]))
    print(f"acceptance on held-out prompts (k={k}, max_new_tokens={n_new}; greedy reference {t_greedy:.1f}s):")
    print(f"{'drafter':>10} {'accept len':>10} {'w/o bonus':>9} {'tok/verify':>10} {'steps':>6} "
          f"{'per-position acceptance':>24} {'=greedy':>8} {'time':>6}")
    for name, (rep, secs) in reports.items():
        pos = " ".join(f"{r:.2f}" for r in rep.per_position_rate)
        print(f"{name:>10} {rep.acceptance_length:>10.3f} {rep.acceptance_length_no_bonus:>9.3f} "
              f"{rep.tokens_per_verification:>10.3f} {rep.verify_steps:>6} {pos:>24} {str(rep.matches_greedy):>8} "
              f"{secs:>5.1f}s")
    floor = recipe.acceptance_floor
    ok = reports["trained"][0].acceptance_length >= floor
    print(f"recipe acceptance floor {floor}: {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
