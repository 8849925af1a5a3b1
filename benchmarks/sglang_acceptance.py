"""One drafter's acceptance three ways on the same prompts: the project's evaluator, SGLang's own EAGLE-3
worker (its per-request counters) and vLLM's (its /metrics counters), serving exports of the same
float32 weights next to the SmolLM2 target (needs ``make sglang``; the vLLM figure also ``make vllm``).

The drafter is the small one tests use (``tests.support.small_drafter``: 40 steps on the
target's own answers to 16 questions), k=3 chain, greedy. ``--target kimi-mini`` does the same for
Kimi-K2.5's architecture: kimi-mini served as ``KimiK25ForConditionalGeneration`` with an MLA drafter
(``Eagle3DeepseekV2ForCausalLM`` in both engines). Prints the figures and records them in
``benchmarks/results/sglang_acceptance.json`` (``sglang_acceptance_kimi_mini.json``).

    .venv/bin/python benchmarks/sglang_acceptance.py [--target smollm2|kimi-mini] [--prompts 8] [--max-new 24]
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

K = 3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", choices=["smollm2", "kimi-mini"], default="smollm2")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=24)
    args = ap.parse_args(argv)

    import torch

    from eagle3_assets.drafter import formats
    from eagle3_assets.drafter.spec_decode import evaluate_acceptance, greedy_generate
    from eagle3_assets.drafter.target_weights import read_target_embeddings
    from eagle3_assets.engines.sglang import acceptance as sglang_acceptance
    from eagle3_assets.engines.sglang.server import SGLangServer
    from eagle3_assets.engines.vllm import acceptance as vllm_acceptance
    from eagle3_assets.engines.vllm.server import VLLMServer, vllm_available
    from eagle3_assets.paths import DataLayout
    from eagle3_assets.target.embedded import EmbeddedModel, ensure_default_model
    from tests.support import small_drafter

    torch.set_num_threads(1)  # the other core is the server's
    models = DataLayout.from_env().models_dir
    kimi = args.target == "kimi-mini"
    if kimi:
        from eagle3_assets.target.kimi_mini import ensure_kimi_mini
        from eagle3_assets.target.tokenizer import TargetTokenizer

        model_dir = ensure_kimi_mini(models)
        embedded = EmbeddedModel(model_dir, tokenizer=TargetTokenizer.load(model_dir, trust_remote_code=True))
    else:
        model_dir = ensure_default_model(models)
        embedded = EmbeddedModel(model_dir)
    prompts = [embedded.render_prompt([{"role": "user", "content": q}]) for q in small_drafter.HELD_OUT[:args.prompts]]
    greedy = [greedy_generate(embedded.model, p, max_new_tokens=args.max_new, stop_ids=embedded.stop_ids)
              for p in prompts]
    figures: dict = {}
    with tempfile.TemporaryDirectory(prefix="eagle3-sglang-acc-") as tmp:
        tmp = Path(tmp)
        features = small_drafter.answer_features(embedded, model_dir, tmp / "features", small_drafter.TRAIN_QUESTIONS,
                                                 max_new_tokens=args.max_new)
        model = small_drafter.train_on_features(features, model_dir, tmp / "train", k=K, attention="mla" if kimi else "llama")
        sglang_dir = formats.export("sglang", model, tmp / "sglang", dtype="float32")
        vllm_dir = formats.export("vllm", model, tmp / "vllm", dtype="float32", verifier=str(model_dir), speculative_tokens=K)

        drafter = formats.load("sglang", sglang_dir, read_target_embeddings(model_dir)).float().eval()
        t0 = time.perf_counter()
        project = evaluate_acceptance(embedded.model, drafter, prompts, k=K, max_new_tokens=args.max_new,
                                      stop_ids=embedded.stop_ids, greedy_reference=greedy)
        figures["project"] = _row(project.acceptance_length, project.verify_steps,
                                  sum(j * n for j, n in enumerate(project.accepted_histogram)),
                                  project.per_position_rate, project.matches_greedy, time.perf_counter() - t0)

        t0 = time.perf_counter()
        with SGLangServer(model_dir, attention_backend="intel_amx", drafter_dir=sglang_dir, speculative_steps=K) as srv:
            ready = time.perf_counter() - t0
            t1 = time.perf_counter()
            eng = sglang_acceptance.measure_acceptance(srv.base_url, prompts, k=K, max_new_tokens=args.max_new,
                                                       greedy_reference=greedy, stop_token_ids=embedded.stop_ids)
            figures["sglang"] = {**_row(eng.acceptance_length, eng.drafts, eng.accepted_tokens, eng.per_position_rate,
                                        eng.matches_greedy, time.perf_counter() - t1), "server_start_s": round(ready, 1)}

        if vllm_available():
            t0 = time.perf_counter()
            with VLLMServer(model_dir, role="speculate", drafter_dir=vllm_dir, num_speculative_tokens=K) as srv:
                ready = time.perf_counter() - t0
                t1 = time.perf_counter()
                eng = vllm_acceptance.measure_acceptance(srv.api_url, prompts, k=K, max_new_tokens=args.max_new,
                                                         greedy_reference=greedy)
                figures["vllm"] = {**_row(eng.acceptance_length, eng.drafts, eng.accepted_tokens,
                                          eng.per_position_rate, eng.matches_greedy, time.perf_counter() - t1),
                                   "server_start_s": round(ready, 1)}
    for name, row in figures.items():
        print(f"{name:>8}: " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    target = "kimi-mini (KimiK25ForConditionalGeneration, MLA), MLA drafter" if kimi else "SmolLM2-135M-Instruct"
    record("sglang_acceptance" + ("_kimi_mini" if kimi else ""), figures,
           note=f"{target}, small_drafter (40 steps), float32 exports, k={K} chain, greedy, "
                f"{len(prompts)} held-out prompts, up to {args.max_new} new tokens; SGLang {K} steps top-k 1 "
                "on its intel_amx backend with the project's CPU kernels")


def _row(al, steps, accepted, per_pos, matches, seconds) -> dict:
    return {"acceptance_length": round(float(al), 4), "verify_steps": int(steps), "accepted_tokens": int(accepted),
            "per_position": " / ".join(f"{x:.3f}" for x in per_pos), "matches_greedy": bool(matches),
            "seconds": round(seconds, 1)}


if __name__ == "__main__":
    main()
