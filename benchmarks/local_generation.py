"""Embedded-model generation: raw model throughput vs the resumable pipeline around it.

Prints tokens/s at batch 1 and batch 16 for bare `EmbeddedModel.generate`, and for
`generate_local` (rendering, budget admission, whole-line fsync'd appends) on the same
prompts, so the ratio shows what resumability costs. Run: `make bench` or
`.venv/bin/python benchmarks/local_generation.py [--prompts 32 --max-new-tokens 64]`.
"""

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from results import record  # noqa: E402

from eagle3_assets.engines.http.samples import SamplingSettings, plan_samples  # noqa: E402
from eagle3_assets.generation.budget import TokenBudget  # noqa: E402
from eagle3_assets.generation.local import generate_local  # noqa: E402
from eagle3_assets.generation.response_store import ResponseStore  # noqa: E402
from eagle3_assets.paths import BUNDLED, DataLayout  # noqa: E402
from eagle3_assets.prompts.reader import read_prompt_file  # noqa: E402
from eagle3_assets.target.embedded import EmbeddedModel, ensure_default_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    model = EmbeddedModel(ensure_default_model(DataLayout.from_env().models_dir))
    prompts = read_prompt_file(BUNDLED / "demo_prompts" / "general.jsonl").prompts[: args.prompts]
    ids = [model.render_prompt(p.messages) for p in prompts]
    n = args.max_new_tokens

    def bare(batch: int) -> float:
        t0, tokens = time.perf_counter(), 0
        for i in range(0, len(ids), batch):
            tokens += sum(len(g.output_ids) for g in model.generate(ids[i : i + batch], max_new_tokens=n))
        return tokens / (time.perf_counter() - t0)

    def pipeline(batch: int) -> float:
        with tempfile.TemporaryDirectory() as tmp:
            settings = SamplingSettings(target=model.name)
            rep = generate_local(model, plan_samples("bench", prompts, settings), ResponseStore(Path(tmp)),
                                 settings, TokenBudget(10**9), max_new_tokens=n, batch_size=batch)
            return rep.tokens_per_s

    bare(16)  # warm-up
    print(f"{len(ids)} prompts, max_new_tokens={n}, torch threads={__import__('torch').get_num_threads()}")
    print(f"{'batch':>6} {'bare tok/s':>11} {'pipeline tok/s':>15} {'ratio':>6}")
    rows = {}
    for batch in (1, 16):
        b, p = bare(batch), pipeline(batch)
        print(f"{batch:>6} {b:>11.1f} {p:>15.1f} {p / b:>6.2f}")
        rows[f"batch {batch}"] = {"bare_tokens_per_s": b, "pipeline_tokens_per_s": p, "ratio": p / b}
    record("local_generation", {"prompts": len(ids), "max_new_tokens": n, "rows": rows})


if __name__ == "__main__":
    main()
