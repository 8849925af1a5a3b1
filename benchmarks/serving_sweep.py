"""The serving benchmark's sweep on the small demo drafter, in every engine with a serve role on this
machine (vLLM's CPU build, SGLang's CPU engine): the target alone and the drafter's exports at each
chain length, at concurrency 1 and a batch level, over the bundled categorized prompts. Prints the
pooled table, acceptance per category, the best setting per engine and concurrency, mismatches and
the wall time; records them in ``benchmarks/results/serving_sweep.json``.

The drafter is the one tests use (``tests.support.small_drafter``: 40 steps on the target's answers
to 16 questions, float32 exports); ``--drafter DIR`` reuses one holding ``sglang/`` and ``vllm/``.
``--target kimi-mini`` runs the same sweep on Kimi-K2.5's architecture: kimi-mini (random weights,
served as ``KimiK25ForConditionalGeneration``, MLA attention) with an MLA drafter
(``Eagle3DeepseekV2ForCausalLM`` in both engines), recorded in ``serving_sweep_kimi_mini.json``.

    .venv/bin/python benchmarks/serving_sweep.py [--target smollm2|kimi-mini] [--chains 1,3] [--concurrency 1,4]
        [--per-category 2] [--max-new 32]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from results import record  # noqa: E402


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def small_drafter_dir(embedded, model_dir, out: Path, k: int, attention: str = "llama") -> Path:
    from eagle3_assets.drafter import formats
    from tests.support import small_drafter

    features = small_drafter.answer_features(embedded, model_dir, out / "features", small_drafter.TRAIN_QUESTIONS)
    model = small_drafter.train_on_features(features, model_dir, out / "train", k=k, attention=attention)
    formats.export("sglang", model, out / "sglang", dtype="float32")
    formats.export("vllm", model, out / "vllm", dtype="float32", verifier=str(model_dir), speculative_tokens=k)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", choices=["smollm2", "kimi-mini"], default="smollm2",
                    help="the bundled target (kimi-mini: with an MLA drafter)")
    ap.add_argument("--drafter", default="", help="a folder holding the sglang/ and vllm/ exports (default: train one)")
    ap.add_argument("--engines", default="", help="comma-separated serve engines (default: all)")
    ap.add_argument("--chains", default="1,3")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--journal", default="", help="the sweep's journal (resumable; default: a temporary one)")
    args = ap.parse_args(argv)

    import torch

    from eagle3_assets.paths import DataLayout
    from eagle3_assets.serving.bench_prompts import bundled_prompts, prompt_set_hash, take_per_category
    from eagle3_assets.serving.journal import Journal
    from eagle3_assets.serving.provenance import machine
    from eagle3_assets.serving.results import ALL, best_settings, mismatches, rows
    from eagle3_assets.serving.sweep import Bench, SweepSpec, run_sweep
    from eagle3_assets.target.catalog import BUILTIN, BUILTIN_SETTINGS
    from eagle3_assets.target.embedded import EmbeddedModel
    from eagle3_assets.target.spec import TargetSpec
    from tests.support import small_drafter

    torch.set_num_threads(1)  # the other core is the server's
    kimi = args.target == "kimi-mini"
    model_dir = BUILTIN[args.target](DataLayout.from_env().models_dir)
    spec = TargetSpec(model_dir, **BUILTIN_SETTINGS.get(args.target, {}))
    tok = spec.load_tokenizer()
    prompts = take_per_category(bundled_prompts(), args.per_category)
    ids = [p.render(tok) for p in prompts]
    trained = {tuple(tok.render_prompt([{"role": "user", "content": q}])) for q in small_drafter.TRAIN_QUESTIONS}
    contaminated = [p.prompt_id for p, i in zip(prompts, ids) if tuple(i) in trained]
    with tempfile.TemporaryDirectory(prefix="eagle3-serving-sweep-") as tmp:
        drafter = Path(args.drafter) if args.drafter else small_drafter_dir(
            EmbeddedModel(model_dir, tokenizer=tok), model_dir, Path(tmp) / "drafter", max(_ints(args.chains)),
            attention="mla" if kimi else "llama")
        bench = Bench(prompts, ids, prompt_set_hash(prompts, ids), model_dir, drafter, spec.identity["id"], machine(),
                      list(spec.stop_token_ids()))
        sweep = SweepSpec(chains=_ints(args.chains), concurrency=_ints(args.concurrency), max_new_tokens=args.max_new,
                          engines=[e for e in args.engines.split(",") if e])
        t0 = time.perf_counter()
        outcome = run_sweep(bench, sweep, Journal(args.journal or Path(tmp) / "journal.jsonl"),
                            log=lambda m: print(m, flush=True))
        wall = time.perf_counter() - t0
    table = rows(outcome.entries)
    bad = mismatches(outcome.entries)
    pooled = {f"{r['engine']} {r['setting']} c{r['concurrency']}": {
        **{k: r[k] for k in ("acceptance_length", "tokens_per_s", "tpot_ms", "ttft_ms", "speedup",
                             "outputs_equal_baseline")},
        "mismatches": sum((m["engine"], m["setting"], m["concurrency"]) == (r["engine"], r["setting"], r["concurrency"])
                          for m in bad)}
        for r in table if r["category"] == ALL}
    per_category = {f"{r['engine']} {r['setting']} c{r['concurrency']} {r['category']}": {
        k: r[k] for k in ("acceptance_length", "tokens_per_s", "speedup")}
        for r in table if r["category"] != ALL and r["steps"] > 0}
    best = {f"{e} c{c}": {"setting": b["setting"], "speedup": b["speedup"], "acceptance_length": b["acceptance_length"]}
            for e, per in best_settings(table).items() for c, b in per.items()}
    print(f"\n{'row':<28} {'AL':>6} {'tok/s':>8} {'TPOT ms':>8} {'TTFT ms':>8} {'speedup':>8} equal")
    for name, r in pooled.items():
        print(f"{name:<28} {r['acceptance_length'] or '':>6} {r['tokens_per_s']:>8} {r['tpot_ms'] or '':>8} "
              f"{r['ttft_ms']:>8} {r['speedup'] or '':>8} {r['outputs_equal_baseline']}")
    print("\nacceptance per category:")
    for name, r in per_category.items():
        print(f"  {name:<44} AL {r['acceptance_length']}  speedup {r['speedup']}")
    print(f"\nbest: {best}\nmismatches: {len(bad)} {bad[:5]}\nmissing: {outcome.missing}\nskipped: {outcome.skipped}"
          f"\ncontaminated: {contaminated}\nwall: {wall:.0f} s, restarts {outcome.restarts}")
    versions = sorted({r["provenance"]["engine_version"] for r in table})
    target = ("kimi-mini (random weights, KimiK25ForConditionalGeneration, MLA) float32, MLA small_drafter" if kimi
              else "SmolLM2-135M-Instruct float32, small_drafter")
    record("serving_sweep" + ("_kimi_mini" if kimi else ""),
           {"pooled": pooled, "per_category": per_category, "best": best,
            "summary": {"wall_s": round(wall, 1), "mismatches": len(bad), "cells": len(outcome.entries),
                        "prompts": len(prompts), "restarts": outcome.restarts},
            "missing": outcome.missing, "skipped": outcome.skipped},
           note=f"{target} (40 steps) float32 exports, greedy, {len(prompts)} bundled "
                f"prompts ({args.per_category} per category), up to {args.max_new} new tokens; engines {versions}; "
                f"machine {bench.machine}; missing {outcome.missing}; skipped {outcome.skipped}; "
                f"mismatches {bad[:10]}")


if __name__ == "__main__":
    main()
