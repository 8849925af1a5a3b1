"""One drafter-quality row's counts prompt by prompt: the replay evaluator, the real chain decoder
(with its near-ties, ``spec_decode.TIE_ULPS``) and vLLM's counters, read after each prompt alone.
Where a row's vLLM total differs from the evaluator's by a step, this names the prompt and says
whether a near-tie explains it.

    .venv/bin/python benchmarks/prompt_counts.py replies8_noise_eagle31_e3 [PROMPT ...] [--no-vllm]

Runs on the ablation's data root (``benchmarks/drafter_quality.py``, default
``data/bench/drafter_quality``) after the row; PROMPT: held-out prompt indices (default: all).
Prints one line per prompt: verification steps and accepted tokens by each, the decoder's
near-ties, and the smallest margin (in float32 units at the larger logit) among the drafts the
replay compares.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quality_eval import greedy_reference, replay_items  # noqa: E402
from quality_recipes import setup_env  # noqa: E402


def nearest_margin(drafter, item, k: int, max_new_tokens: int) -> float:
    """The smallest top-2 logit gap, in float32 units at the larger logit, among the drafts the
    replay's walk compares on this prompt (the accepted ones and the first rejected one per step)."""
    import torch

    from eagle3_assets.drafter.replay_acceptance import chains

    a, _ = chains(drafter, item, k)
    with torch.no_grad():
        top = [s[0].topk(2).values for s in drafter(item.ids[None], item.aux[None].float(), ttt_steps=k)]
    eps, best = torch.finfo(torch.float32).eps, float("inf")
    n_real, produced = item.prompt_len, 1
    while produced < max_new_tokens and n_real - item.prompt_len < item.reply_len:
        t = n_real - 1
        for s in range(min(a[t], k - 1) + 1):
            hi, lo = top[s][t].tolist()
            best = min(best, (hi - lo) / (eps * max(1.0, abs(hi))))
        n_real += 1 + a[t]
        produced += 1 + a[t]
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("row")
    ap.add_argument("prompts", nargs="*", type=int)
    ap.add_argument("--root", type=Path, default=Path("data/bench/drafter_quality"))
    ap.add_argument("--no-vllm", action="store_true")
    args = ap.parse_args()
    root = args.root.resolve()
    setup_env(root)
    import contextlib

    import torch

    from eagle3_assets.drafter.evaluate import eval_prompts, load_export
    from eagle3_assets.drafter.recipes import load_recipe
    from eagle3_assets.drafter.replay_acceptance import replay_one
    from eagle3_assets.drafter.spec_decode import speculative_generate
    from eagle3_assets.drafter.target_weights import read_target_embeddings
    from eagle3_assets.drafter.vllm_acceptance import _stop_ids
    from eagle3_assets.engines.vllm.acceptance import measure_acceptance
    from eagle3_assets.engines.vllm.server import VLLMServer
    from eagle3_assets.paths import DataLayout
    from eagle3_assets.target.embedded import ensure_default_model
    from eagle3_assets.target.loading import load_causal_lm

    torch.set_num_threads(1)  # the other core is vLLM's
    layout, recipe = DataLayout.from_env(), load_recipe(args.row)
    ev, model_dir = recipe.evaluation, ensure_default_model(layout.models_dir)
    k, n = ev.speculative_k, ev.eval_max_new_tokens
    drafter = load_export(layout.drafter_dir(args.row), read_target_embeddings(model_dir)).float().eval()
    prompts = eval_prompts(layout, recipe.datasets, ev.eval_samples)
    items = replay_items(root, layout, prompts, n, drafter.config.aux_layer_ids)
    greedy = greedy_reference(root, layout, prompts, n)
    stops, target = _stop_ids(model_dir, False), load_causal_lm(model_dir).float().eval()
    serve = contextlib.nullcontext() if args.no_vllm else VLLMServer(
        model_dir, role="speculate", drafter_dir=layout.drafter_dir(args.row) / "vllm", num_speculative_tokens=k)
    print(f"{args.row}: {len(prompts)} held-out prompts, k={k}, up to {n} new tokens; steps/accepted per prompt")
    with serve as server:
        for i in args.prompts or range(len(prompts)):
            replay = replay_one(drafter, items[i], k=k, max_new_tokens=n, stop_ids=stops)
            real = speculative_generate(target, drafter, prompts[i], k=k, max_new_tokens=n, stop_ids=stops)
            line = (f"prompt {i}: replay {len(replay.accepted)}/{sum(replay.accepted)}, "
                    f"decoder {len(real.accepted)}/{sum(real.accepted)} (near-ties {len(real.ties)})")
            if server is not None:
                eng = measure_acceptance(server.api_url, [prompts[i]], k=k, max_new_tokens=n, greedy_reference=[greedy[i]])
                line += f", vLLM {eng.drafts}/{eng.accepted_tokens} (greedy {eng.matches_greedy})"
            print(f"{line}; nearest draft {nearest_margin(drafter, items[i], k, n):.1f} float32 units", flush=True)


if __name__ == "__main__":
    main()
