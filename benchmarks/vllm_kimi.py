"""Kimi-K2.5's path through vLLM on kimi-mini, side by side with the project's own code (needs ``make vllm``).

1. Generation: kimi-mini served by vLLM (``KimiK25ForConditionalGeneration``, chat completions with
   ``return_token_ids``) at 1 and 8 requests in flight, tokens/s next to transformers' greedy
   decoding in this process (the yardstick), and how many replies and tokens agree.
2. Extraction: vLLM's ``extract_hidden_states`` through the project's connector vs the local
   extractor on the same sequences: tokens/s of each, max difference per layer (float32).
3. The MLA drafter vs the Llama-style drafter at equal data (same answers, steps, seed), by the
   project's evaluator; and the MLA drafter's acceptance by vLLM's ``/metrics`` counters.

    .venv/bin/python benchmarks/vllm_kimi.py [--train 64] [--eval 16] [--steps 150] [--max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from results import record  # noqa: E402

from eagle3_assets.engines.vllm.server import VLLMServer, vllm_available  # noqa: E402
from eagle3_assets.target.kimi_mini import ensure_kimi_mini  # noqa: E402

LAYER_IDS = [1, 2, 3]


FIGURES: dict = {}  # what main() records, filled where each figure is printed


def demo_questions() -> list[str]:
    """The first user turn of every bundled demo prompt (general, coding, math interleaved)."""
    from eagle3_assets.paths import BUNDLED

    per = []
    for name in ("general", "coding", "math"):
        rows = [json.loads(line) for line in (BUNDLED / "demo_prompts" / f"{name}.jsonl").read_text().splitlines()]
        per.append([first_user_turn(r) for r in rows])
    return [q for trio in zip(*per) for q in trio]


def first_user_turn(row: dict) -> str:
    """The first user message of a prompt row in either shape the demo files use."""
    if "messages" in row:
        return next(m["content"] for m in row["messages"] if m["role"] == "user")
    return next(t["value"] for t in row["conversations"] if t["from"] == "human")


def generation(kimi, questions: list[str], args) -> None:
    import httpx

    from eagle3_assets.drafter.spec_decode import greedy_generate

    prompts = [kimi.render_prompt([{"role": "user", "content": q}]) for q in questions]
    t0 = time.perf_counter()
    local = [greedy_generate(kimi.model, p, max_new_tokens=args.max_new_tokens, stop_ids=kimi.stop_ids) for p in prompts]
    t_local = time.perf_counter() - t0
    with VLLMServer(kimi.model_dir, role="generate") as server:
        def ask(q):
            body = {"model": server.served_name, "messages": [{"role": "user", "content": q}], "temperature": 0.0,
                    "max_tokens": args.max_new_tokens, "return_token_ids": True}
            r = httpx.post(server.api_url + "/chat/completions", json=body, timeout=600).json()
            return r["prompt_token_ids"], r["choices"][0]["token_ids"]

        ask(questions[0])  # warm-up
        figures = {}
        for conc in (1, 8):
            t0 = time.perf_counter()
            with ThreadPoolExecutor(conc) as pool:
                got = list(pool.map(ask, questions))
            figures[conc] = (time.perf_counter() - t0, got)
    n_local = sum(map(len, local))
    print(f"\n== generation: {len(questions)} demo prompts, <= {args.max_new_tokens} new tokens, greedy")
    print(f"transformers greedy (this process, one at a time): {n_local / t_local:7.1f} tokens/s ({t_local:.1f} s)")
    FIGURES["generation"] = {"prompts": len(questions), "transformers_tokens_per_s": n_local / t_local, "vllm": {}}
    for conc, (secs, got) in figures.items():
        out = [o for _, o in got]
        tokens = sum(map(len, out))
        same_prompt = sum(p == q for (p, _), q in zip(got, prompts))
        same = sum(o == g for o, g in zip(out, local))
        agree = sum(a == b for o, g in zip(out, local) for a, b in zip(o, g)) / max(1, sum(map(len, local)))
        print(f"vLLM, {conc} in flight: {tokens / secs:7.1f} tokens/s ({secs:.1f} s; x{t_local / secs * tokens / n_local:.2f} "
              f"of transformers); prompts rendered alike {same_prompt}/{len(prompts)}; replies equal {same}/{len(out)}; "
              f"tokens equal {agree:.4f}")
        FIGURES["generation"]["vllm"][f"{conc} in flight"] = {
            "tokens_per_s": tokens / secs, "prompts_rendered_alike": same_prompt, "replies_equal": same, "tokens_equal": agree}


def extraction(kimi, questions: list[str], args) -> None:
    from eagle3_assets.drafter.spec_decode import greedy_generate
    from eagle3_assets.engines.local.extractor import LocalExtractor
    from eagle3_assets.engines.vllm.extractor import VLLMExtractor, vllm_layer_ids

    prompts = [kimi.render_prompt([{"role": "user", "content": q}]) for q in questions]
    rows = [p + greedy_generate(kimi.model, p, max_new_tokens=args.max_new_tokens, stop_ids=kimi.stop_ids)
            for p in prompts]
    tokens = sum(map(len, rows))
    local = LocalExtractor(kimi.model_dir, model=kimi.model, layer_ids=LAYER_IDS)
    local.extract(rows[:2])
    with VLLMServer(kimi.model_dir, role="extract", vllm_layer_ids=vllm_layer_ids(LAYER_IDS, 7)) as server:
        remote = VLLMExtractor(server.api_url, kimi.model_dir, layer_ids=LAYER_IDS, concurrency=8)
        remote.extract(rows[:2])
        t0 = time.perf_counter()
        got = remote.extract(rows)
        t_remote = time.perf_counter() - t0
        remote.close()
    t0 = time.perf_counter()
    want = local.extract(rows)
    t_local = time.perf_counter() - t0
    print(f"\n== extraction: {len(rows)} sequences, {tokens} tokens (prompt + greedy reply), float32")
    print(f"local extractor: {tokens / t_local:8.0f} tokens/s; vLLM (8 in flight): {tokens / t_remote:8.0f} tokens/s "
          f"(ratio vLLM/local {t_local / t_remote:.2f})")
    FIGURES["extraction"] = {"tokens": tokens, "local_tokens_per_s": tokens / t_local, "vllm_tokens_per_s": tokens / t_remote,
                             "states": {}}
    names = [f"aux layer {i}" for i in LAYER_IDS] + ["final (post-norm)"]
    for j, name in enumerate(names):
        def pick(f, j=j):
            return f.aux[:, j * 64:(j + 1) * 64] if j < 3 else f.last

        a, b = torch.cat([pick(f) for f in got]), torch.cat([pick(f) for f in want])
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()
        FIGURES["extraction"]["states"][name] = {"max_abs": (a - b).abs().max().item(), "scale": b.abs().max().item(),
                                                 "min_cos": cos}
        print(f"  {name:18s} max |diff| {(a - b).abs().max().item():.3e} (values up to {b.abs().max().item():.3e}); "
              f"min cosine {cos:.8f}")


def drafters(kimi, train_q: list[str], eval_q: list[str], args) -> None:
    from eagle3_assets.drafter import formats
    from eagle3_assets.drafter.spec_decode import evaluate_acceptance, greedy_generate
    from eagle3_assets.engines.vllm.acceptance import compare, measure_acceptance
    from tests.support.small_drafter import answer_features, export_vllm_float, train_on_features

    prompts = [kimi.render_prompt([{"role": "user", "content": q}]) for q in eval_q]
    greedy = [greedy_generate(kimi.model, p, max_new_tokens=args.max_new_tokens, stop_ids=kimi.stop_ids) for p in prompts]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        feats = answer_features(kimi, kimi.model_dir, Path(tmp) / "features", train_q, max_new_tokens=args.max_new_tokens)
        print(f"\n== drafters at equal data: {len(train_q)} answers ({time.perf_counter() - t0:.0f} s to make), "
              f"{args.steps} steps each, k={args.k}; {len(eval_q)} held-out prompts, <= {args.max_new_tokens} tokens")
        reports, exports = {}, {}
        for kind in ("llama", "mla"):
            t0 = time.perf_counter()
            model = train_on_features(feats, kimi.model_dir, Path(tmp) / kind, k=args.k, steps=args.steps,
                                      attention=kind, draft_vocab_size=2048, intermediate_size=128)
            secs = time.perf_counter() - t0
            exports[kind] = export_vllm_float(model, kimi.model_dir, Path(tmp) / f"{kind}-vllm", k=args.k)
            served = formats.load("vllm", exports[kind]).float().eval()  # what vLLM loads, rebuilt from the files
            rep = evaluate_acceptance(kimi.model, served, prompts, k=args.k, max_new_tokens=args.max_new_tokens,
                                      stop_ids=kimi.stop_ids, greedy_reference=greedy)
            reports[kind] = rep
            params = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("embed_tokens"))
            print(f"{kind:5s}: acceptance length {rep.acceptance_length:.3f} (per position "
                  f"{[round(x, 3) for x in rep.per_position_rate]}), equals greedy {rep.matches_greedy}; "
                  f"{params / 1e6:.2f}M trainable parameters, trained in {secs:.0f} s")
            FIGURES.setdefault("drafters", {})[kind] = {
                "acceptance_length": rep.acceptance_length, "per_position_rate": list(rep.per_position_rate),
                "matches_greedy": rep.matches_greedy, "trainable_parameters": params, "train_s": secs}
        with VLLMServer(kimi.model_dir, role="speculate", drafter_dir=exports["mla"], num_speculative_tokens=args.k) as s:
            engine = measure_acceptance(s.api_url, prompts, k=args.k, max_new_tokens=args.max_new_tokens,
                                        greedy_reference=greedy)
    print("MLA drafter, vLLM's counters vs the project's evaluator:")
    FIGURES["mla_vllm_vs_project"] = compare(reports["mla"].as_metadata(), engine)
    print(json.dumps(FIGURES["mla_vllm_vs_project"], indent=2))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train", type=int, default=64, help="demo prompts whose answers train the drafters")
    p.add_argument("--eval", type=int, default=16, help="held-out demo prompts")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--skip", action="append", choices=["generation", "extraction", "drafters"], default=[])
    args = p.parse_args()
    if not vllm_available():
        print("no vLLM environment: run `make vllm` first", file=sys.stderr)
        return 2
    from eagle3_assets.target.embedded import EmbeddedModel
    from eagle3_assets.target.tokenizer import TargetTokenizer

    model_dir = ensure_kimi_mini(Path(os.environ.get("EAGLE3_MODEL_CACHE") or ROOT / "data" / "models"))
    kimi = EmbeddedModel(model_dir, tokenizer=TargetTokenizer.load(model_dir, trust_remote_code=True))
    questions = demo_questions()
    train_q, eval_q = questions[:args.train], questions[args.train:args.train + args.eval]
    print(f"kimi-mini ({model_dir}); torch threads here: {torch.get_num_threads()}; load: {os.getloadavg()[0]:.2f}")
    if "generation" not in args.skip:
        generation(kimi, eval_q, args)
    if "extraction" not in args.skip:
        extraction(kimi, eval_q, args)
    if "drafters" not in args.skip:
        drafters(kimi, train_q, eval_q, args)
    record("vllm_kimi", FIGURES)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
