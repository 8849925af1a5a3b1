"""Generation through a real SGLang server beside the project's local backend and vLLM, on the same
prompt ids, at 1 and at 32 requests in flight (needs ``make sglang``; vLLM is skipped without ``make vllm``).

Tokens are the engines' own counts (SGLang's ``meta_info.completion_tokens``, vLLM's
``usage.completion_tokens``; the local backend's output lengths); both servers run with
``ignore_eos`` so every request makes ``--max-new-tokens`` tokens. Greedy, float32 everywhere.

    .venv/bin/python benchmarks/sglang_generation.py [--prompts 32] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from results import record  # noqa: E402

from eagle3_assets.engines.sglang.server import SGLangServer, installed_version  # noqa: E402
from eagle3_assets.engines.vllm.server import VLLMServer, vllm_available  # noqa: E402
from eagle3_assets.paths import BUNDLED, DataLayout  # noqa: E402
from eagle3_assets.prompts.reader import read_prompt_file  # noqa: E402
from eagle3_assets.target.embedded import EmbeddedModel, ensure_default_model  # noqa: E402

FIGURES: dict = {}


async def _run(post, prompts: list[list[int]], in_flight: int) -> tuple[float, int]:
    """Wall seconds and completion tokens for all prompts with at most ``in_flight`` requests open."""
    gate = asyncio.Semaphore(in_flight)
    async with httpx.AsyncClient(timeout=1800.0) as client:
        async def one(ids):
            async with gate:
                return await post(client, ids)

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - t0, sum(counts)


def sglang_post(url: str, n: int):
    async def post(client, ids):
        r = await client.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}})
        r.raise_for_status()
        return r.json()["meta_info"]["completion_tokens"]
    return post


def vllm_post(url: str, name: str, n: int):
    async def post(client, ids):
        r = await client.post(url + "/completions", json={"model": name, "prompt": ids, "max_tokens": n,
                                                          "temperature": 0.0, "ignore_eos": True})
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]
    return post


def report(engine: str, in_flight: int, seconds: float, tokens: int) -> None:
    rate = tokens / seconds
    FIGURES[f"{engine} x{in_flight}"] = {"engine": engine, "in_flight": in_flight, "tokens": tokens,
                                         "seconds": round(seconds, 2), "tokens_per_s": round(rate, 1)}
    print(f"{engine:>7} | {in_flight:>3} in flight | {tokens:>6} tokens | {seconds:7.1f} s | {rate:7.1f} tok/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--serial-prompts", type=int, default=8, help="prompts for the 1-in-flight runs")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    model_dir = ensure_default_model(DataLayout.from_env().models_dir)
    model = EmbeddedModel(model_dir)
    prompts = read_prompt_file(BUNDLED / "demo_prompts" / "general.jsonl").prompts[: args.prompts]
    ids = [model.render_prompt(p.messages) for p in prompts]
    n = args.max_new_tokens
    runs = [(1, ids[: args.serial_prompts]), (min(32, len(ids)), ids)]

    for in_flight, batch in runs:  # the local backend: batches of in_flight prompts
        t0, tokens = time.perf_counter(), 0
        for i in range(0, len(batch), in_flight):
            tokens += sum(len(g.output_ids) for g in model.generate(batch[i:i + in_flight], max_new_tokens=n))
        report("local", in_flight, time.perf_counter() - t0, tokens)
    del model

    with SGLangServer(model_dir) as server:
        print(f"SGLang {installed_version(server.python)} CPU engine at {server.base_url}", flush=True)
        for in_flight, batch in runs:
            report("sglang", in_flight, *asyncio.run(_run(sglang_post(server.base_url, n), batch, in_flight)))

    if vllm_available():
        with VLLMServer(model_dir, role="generate") as server:
            for in_flight, batch in runs:
                post = vllm_post(server.api_url, server.served_name, n)
                report("vllm", in_flight, *asyncio.run(_run(post, batch, in_flight)))
    else:
        print("vLLM: no environment (make vllm); skipped")

    base = {k: v["tokens_per_s"] for k, v in FIGURES.items()}
    for in_flight, _ in runs:
        local = base.get(f"local x{in_flight}")
        for engine in ("sglang", "vllm"):
            if local and f"{engine} x{in_flight}" in base:
                print(f"{engine} / local at {in_flight} in flight: {base[f'{engine} x{in_flight}'] / local:.2f}x")
    record("sglang_generation", FIGURES, note="greedy, float32; servers with ignore_eos; the local backend stops "
           "at its end of turn, so its token count is what it generated")


if __name__ == "__main__":
    main()
