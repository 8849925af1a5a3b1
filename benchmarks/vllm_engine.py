"""vLLM in the loop, side by side with the project's own code in one run (needs ``make vllm``).

1. Hidden-state extraction on the same sequences: the local extractor (transformers, in this
   process) vs a vLLM extraction server (``extract_hidden_states`` + the project's CPU connector,
   files read and removed by the client); tokens/s of each and the ratio, and how far apart the
   states are (max absolute difference, max per-token relative error, min cosine), per layer.
2. Acceptance length of one drafter measured by vLLM serving it (``/metrics`` counters) vs the
   project's chain speculative decoder on the same prompts, and whether each equals greedy.
   With ``--recipe NAME`` the trained recipe's export and held-out prompts (``make demo`` makes
   ``demo``); otherwise a small drafter trained here.

    .venv/bin/python benchmarks/vllm_engine.py [--sequences 48] [--length 256] [--recipe demo]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from results import record  # noqa: E402

from eagle3_assets.engines.local.extractor import LocalExtractor  # noqa: E402
from eagle3_assets.engines.vllm.extractor import VLLMExtractor, vllm_layer_ids  # noqa: E402
from eagle3_assets.engines.vllm.server import VLLMServer, vllm_available  # noqa: E402
from eagle3_assets.hidden_states.extract import plan_batches  # noqa: E402
from eagle3_assets.target.embedded import ensure_default_model  # noqa: E402

LAYER_IDS = [1, 14, 26]


FIGURES: dict = {}  # what main() records, filled where each figure is printed


def sequences(n: int, length: int, vocab: int) -> list[list[int]]:
    """Lengths spread over [length/4, length] like a real corpus; fixed seed."""
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(length // 4, length + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lens]


def run_extractor(extractor, rows, batch_tokens: int) -> tuple[list, float]:
    feats = [None] * len(rows)
    t0 = time.perf_counter()
    for batch in plan_batches([len(r) for r in rows], batch_tokens):
        for i, f in zip(batch, extractor.extract([rows[i] for i in batch])):
            feats[i] = f
    return feats, time.perf_counter() - t0


def compare_states(a, b) -> dict:
    a, b = a.float(), b.float()
    rel = ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-6)).max().item()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()
    return {"max_abs": (a - b).abs().max().item(), "max_rel": rel, "min_cos": cos, "scale": b.abs().max().item()}


def extraction(model_dir: Path, args) -> None:
    rows = sequences(args.sequences, args.length, 49152)
    tokens = sum(map(len, rows))
    print(f"\n== extraction: {len(rows)} sequences, {tokens:,} tokens, batches of <= {args.batch_tokens} tokens, "
          f"{torch.get_num_threads()} torch threads here")
    local = LocalExtractor(model_dir, layer_ids=LAYER_IDS)
    run_extractor(local, rows[:2], args.batch_tokens)  # warm-up
    with VLLMServer(model_dir, role="extract", vllm_layer_ids=vllm_layer_ids(LAYER_IDS, 30)) as server:
        remote = VLLMExtractor(server.api_url, model_dir, layer_ids=LAYER_IDS, concurrency=args.concurrency)
        run_extractor(remote, rows[:2], args.batch_tokens)  # warm-up
        # alternate the two so load from other processes hits both alike
        t_local = t_remote = 0.0
        got_l, got_r = [None] * len(rows), [None] * len(rows)
        for batch in plan_batches([len(r) for r in rows], args.batch_tokens):
            sub = [rows[i] for i in batch]
            t0 = time.perf_counter()
            fl = local.extract(sub)
            t1 = time.perf_counter()
            fr = remote.extract(sub)
            t2 = time.perf_counter()
            t_local += t1 - t0
            t_remote += t2 - t1
            for i, a, b in zip(batch, fl, fr):
                got_l[i], got_r[i] = a, b
        remote.close()
        left = len(list(Path(server.storage_dir).iterdir()))
    print(f"local extractor (transformers, in-process): {tokens / t_local:8.0f} tokens/s ({t_local:.1f} s)")
    print(f"vLLM server (concurrency {args.concurrency}):          {tokens / t_remote:8.0f} tokens/s ({t_remote:.1f} s)")
    print(f"ratio vLLM / local: {t_local / t_remote:.2f}   files left on the server's storage: {left}")
    FIGURES["extraction"] = {"tokens": tokens, "local_tokens_per_s": tokens / t_local, "vllm_tokens_per_s": tokens / t_remote,
                             "files_left": left, "states": {}}
    h = 576
    names = [f"aux layer {i}" for i in LAYER_IDS] + ["final (post-norm)"]
    for j, name in enumerate(names):
        def pick(f, j=j):
            return f.aux[:, j * h:(j + 1) * h] if j < 3 else f.last

        c = compare_states(torch.cat([pick(f) for f in got_r]), torch.cat([pick(f) for f in got_l]))
        FIGURES["extraction"]["states"][name] = c
        print(f"  {name:18s} max |diff| {c['max_abs']:.3e} (values up to {c['scale']:.3e}); "
              f"max per-token relative error {c['max_rel']:.2e}; min cosine {c['min_cos']:.8f}")


def acceptance(model_dir: Path, args) -> None:
    from eagle3_assets.drafter.vllm_acceptance import measure_recipe
    from eagle3_assets.engines.vllm.acceptance import compare, measure_acceptance

    if args.recipe:
        print(f"\n== acceptance of recipe {args.recipe!r}: vLLM vs the project's evaluator (eval.json)")
        r = measure_recipe(args.recipe)
        print(json.dumps({k: v for k, v in r.items() if k != "engine"}, indent=2))
        FIGURES["acceptance"] = {k: v for k, v in r.items() if k != "engine"}
        return
    from eagle3_assets.drafter import formats
    from eagle3_assets.drafter.spec_decode import evaluate_acceptance, greedy_generate
    from eagle3_assets.target.embedded import EmbeddedModel
    from tests.support.small_drafter import HELD_OUT, train_small_drafter

    embedded = EmbeddedModel(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        export = train_small_drafter(embedded, model_dir, Path(tmp), k=args.k)
        prompts = [embedded.render_prompt([{"role": "user", "content": q}]) for q in HELD_OUT]
        greedy = [greedy_generate(embedded.model, p, max_new_tokens=args.max_new_tokens, stop_ids=embedded.stop_ids)
                  for p in prompts]
        project = evaluate_acceptance(embedded.model, formats.load("vllm", export).float().eval(), prompts, k=args.k,
                                      max_new_tokens=args.max_new_tokens, stop_ids=embedded.stop_ids,
                                      greedy_reference=greedy)
        with VLLMServer(model_dir, role="speculate", drafter_dir=export, num_speculative_tokens=args.k) as server:
            engine = measure_acceptance(server.api_url, prompts, k=args.k, max_new_tokens=args.max_new_tokens,
                                        greedy_reference=greedy)
    print(f"\n== acceptance of a small drafter trained here: {len(prompts)} held-out prompts, k={args.k}, "
          f"<= {args.max_new_tokens} new tokens")
    FIGURES["acceptance"] = compare(project.as_metadata(), engine)
    print(json.dumps(FIGURES["acceptance"], indent=2))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sequences", type=int, default=48)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--recipe", default="", help="a trained recipe (e.g. demo) instead of the small drafter")
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--skip", choices=["extraction", "acceptance"], default=None)
    args = p.parse_args()
    if not vllm_available():
        print("no vLLM environment: run `make vllm` first", file=sys.stderr)
        return 2
    model_dir = ensure_default_model(Path(os.environ.get("EAGLE3_MODEL_CACHE") or ROOT / "data" / "models"))
    if args.skip != "extraction":
        extraction(model_dir, args)
    if args.skip != "acceptance":
        acceptance(model_dir, args)
    record("vllm_engine", FIGURES)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
