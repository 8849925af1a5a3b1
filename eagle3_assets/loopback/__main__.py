"""``python -m eagle3_assets.loopback sglang|openrouter --port N [...]``; see the package docstring."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eagle3_assets.loopback", description=__doc__)
    p.add_argument("protocol", choices=["sglang", "openrouter"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on start)")
    p.add_argument("--synthetic", action="store_true", help="fake deterministic ids, for load tests only")
    p.add_argument("--model-dir", default="", help="model directory or a bundled target: smollm2 (default), kimi-mini")
    p.add_argument("--latency", type=float, default=0.0, help="simulated seconds added to every generation")
    p.add_argument("--latency-jitter", type=float, default=0.0, help="plus uniform(0, this) seconds")
    p.add_argument("--latency-exp", action="store_true", help="--latency is the mean of an exponential draw")
    p.add_argument("--latency-per-token", type=float, default=0.0, help="plus this many seconds per generated token")
    p.add_argument("--lengths", default="uniform",
                   help="synthetic reply lengths: uniform, or lognormal:MEDIAN:SIGMA (heavy-tailed)")
    p.add_argument("--group-by-prefix", action="store_true",
                   help="count requests in flight by the text before ':' in the first message (e.g. the dataset)")
    p.add_argument("--faults", default="", help="e.g. 429=0.05,502=0.05,heartbeat=0.2,drop=0.01")
    p.add_argument("--script", default="", help="scripted faults in arrival order, e.g. ok,429,ok,401")
    p.add_argument("--then", default="", help="fault for every request after the script (default: --faults)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--retry-after", type=float, default=1.0, help="Retry-After seconds sent with 429/503/402")
    p.add_argument("--slow", type=float, default=2.0, help="extra seconds of a 'slow' fault")
    p.add_argument("--prefix-bug", type=float, default=0.0, help="sglang: probability of the output_ids prefix bug")
    p.add_argument("--unhealthy", action="store_true", help="sglang: /health_generate answers 503")
    p.add_argument("--api-key", default=None, help="openrouter: the only accepted bearer token")
    p.add_argument("--price-in", type=float, default=0.60, help="openrouter: $ per million prompt tokens")
    p.add_argument("--price-out", type=float, default=2.50, help="openrouter: $ per million completion tokens")
    p.add_argument("--credits", type=float, default=None, help="openrouter: 402 credits once this much is billed")
    p.add_argument("--key-usage", type=float, default=0.0, help="openrouter: dollars the key had spent before")
    p.add_argument("--drops-tools", action="store_true",
                   help="openrouter: ignore `tools` unless routing asks for require_parameters")
    p.add_argument("--max-batch", type=int, default=16, help="model batch size limit")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--uvloop", action="store_true", help="serve on uvloop when installed")
    return p


def make_app(args):
    from .faults import FaultPlan
    from .generators import ModelGenerator, SyntheticGenerator
    from .openrouter_app import OpenRouterApp
    from .sglang_app import SGLangApp

    if args.synthetic:
        kind, _, rest = args.lengths.partition(":")
        median, _, sigma = rest.partition(":")
        gen = SyntheticGenerator(lengths=kind, median=float(median or 64), sigma=float(sigma or 1.0))
    else:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from eagle3_assets.paths import REPO_ROOT
        from eagle3_assets.target.catalog import BUILTIN_SETTINGS, resolve_model_dir
        from eagle3_assets.target.embedded import EmbeddedModel
        from eagle3_assets.target.tokenizer import TargetTokenizer

        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        model_dir = resolve_model_dir(args.model_dir, os.environ.get("EAGLE3_MODEL_CACHE") or REPO_ROOT / "data" / "models")
        remote = BUILTIN_SETTINGS.get(args.model_dir, {}).get("trust_remote_code", False)
        tok = TargetTokenizer.load(model_dir, trust_remote_code=remote)
        gen = ModelGenerator(EmbeddedModel(model_dir, tokenizer=tok), max_batch=args.max_batch)
    faults = FaultPlan.from_strings(args.faults, args.script, then=args.then, seed=args.seed,
                                    retry_after_s=args.retry_after, slow_s=args.slow)
    from .observe import prefix_group

    common = dict(faults=faults, latency_s=args.latency, latency_jitter_s=args.latency_jitter,
                  latency_exponential=args.latency_exp, latency_per_token_s=args.latency_per_token,
                  group_of=prefix_group if args.group_by_prefix else None, seed=args.seed)
    if args.protocol == "sglang":
        return SGLangApp(gen, prefix_bug=args.prefix_bug, healthy=not args.unhealthy, **common)
    return OpenRouterApp(gen, api_key=args.api_key, prompt_price=args.price_in / 1e6,
                         completion_price=args.price_out / 1e6, credits_usd=args.credits,
                         key_usage_start_usd=args.key_usage, drops_tools=args.drops_tools, **common)


async def amain(args) -> None:
    app = make_app(args)
    server = await app.start(args.host, args.port)
    label = " (SYNTHETIC ids: load tests only)" if app.gen.synthetic else f" (model {app.gen.name})"
    print(f"listening on {server.url}{label}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await app.aclose()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.uvloop:
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            print("uvloop is not installed; using asyncio's loop", file=sys.stderr)
    asyncio.run(amain(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
