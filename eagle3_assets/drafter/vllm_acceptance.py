"""A trained recipe's acceptance measured by a serving engine, next to the project's evaluator: a measurement run by hand.

``python -m eagle3_assets.drafter.vllm_acceptance demo`` serves the recipe's vLLM export next to its
target through the engine's serve role (:mod:`eagle3_assets.engines.roles`; vLLM's reads its
Prometheus counters, :mod:`eagle3_assets.engines.vllm.acceptance`), measures acceptance on the
recipe's held-out prompts and prints it next to the project's figure (``eval.json``).
``measure_recipe(..., engine=...)`` takes any engine serving the role, with its export under
``drafters/<recipe>/<engine>/``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from eagle3_assets.engines import engine_role
from eagle3_assets.engines.roles import compare


def measure_recipe(recipe_name: str, *, python: str | None = None, layout=None, trust_remote_code: bool = False,
                   engine: str = "vllm") -> dict:
    """Serve a trained recipe's export for ``engine`` next to its target, measure acceptance on the
    recipe's held-out prompts, compare with ``eval.json``; written to
    ``drafters/<recipe>/<engine>_acceptance.json``. ``trust_remote_code``: the target's tokenizer is
    code (Kimi), read for its end of turn."""
    from eagle3_assets.drafter.evaluate import eval_prompts
    from eagle3_assets.drafter.recipes import load_recipe
    from eagle3_assets.paths import DataLayout
    from eagle3_assets.target.catalog import resolve_model_dir

    layout = layout or DataLayout.from_env()
    recipe = load_recipe(recipe_name)
    out = layout.drafter_dir(recipe.name)
    ev_path = out / "eval.json"
    serve = engine_role("serve", engine)
    if not ev_path.exists() or not (out / engine / "config.json").exists():
        raise FileNotFoundError(f"{out}: no trained drafter (eval.json and {engine}/): "
                                f"materialize drafter_checkpoint[{recipe.name}]")
    ev = json.loads(ev_path.read_text())
    from eagle3_assets.drafter.export_review import evaluation_link_problems

    changed = evaluation_link_problems(ev, out, [engine], recipe.name)  # the export served is the one measured
    if changed:
        raise ValueError("; ".join(changed))
    trained_on = json.loads((out / "job.json").read_text()).get("target", {}).get("model_dir")
    model_dir = Path(trained_on or resolve_model_dir("", layout.models_dir))
    prompts = eval_prompts(layout, recipe.datasets, recipe.evaluation.eval_samples)
    stops = _stop_ids(model_dir, trust_remote_code)
    greedy = _greedy(model_dir, prompts, recipe.evaluation.eval_max_new_tokens, stops)
    with serve.server(model_dir, out / engine, k=ev["k"], python=python or "") as server:
        measured = serve.acceptance(serve.url(server), prompts, k=ev["k"], max_new_tokens=ev["max_new_tokens"],
                                    greedy_reference=greedy, stop_token_ids=stops)
    result = {**compare(ev["trained"], measured, engine), "recipe": recipe.name, "prompts": len(prompts), "k": ev["k"],
              "max_new_tokens": ev["max_new_tokens"], "engine": measured.as_metadata()}
    (out / f"{engine}_acceptance.json").write_text(json.dumps(result, indent=2))
    return result


def _stop_ids(model_dir: Path, trust_remote_code: bool) -> list[int]:
    """The target's eos ids and its template's end of turn."""
    from eagle3_assets.target.stops import decode_stop_ids
    from eagle3_assets.target.tokenizer import TargetTokenizer

    return decode_stop_ids(model_dir, TargetTokenizer.load(model_dir, trust_remote_code=trust_remote_code))


def _greedy(model_dir: Path, prompts, max_new_tokens: int, stop_ids: list[int]) -> list[list[int]]:
    from eagle3_assets.drafter.spec_decode import greedy_generate
    from eagle3_assets.target.loading import load_causal_lm

    target = load_causal_lm(model_dir)  # a multimodal wrapper's language model too (Kimi-K2.5)
    return [greedy_generate(target, p, max_new_tokens=max_new_tokens, stop_ids=stop_ids) for p in prompts]


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m eagle3_assets.drafter.vllm_acceptance",
                                description="A trained recipe's acceptance in vLLM next to the project's evaluator.")
    p.add_argument("recipe")
    p.add_argument("--python", default="", help="the vLLM environment's python (default: .venv-vllm)")
    p.add_argument("--trust-remote-code", action="store_true", help="the target's tokenizer is code (Kimi's)")
    args = p.parse_args(argv)
    r = measure_recipe(args.recipe, python=args.python or None, trust_remote_code=args.trust_remote_code)
    print(f"{args.recipe}: acceptance length {r['vllm_acceptance_length']:.4f} (vLLM) vs "
          f"{r['project_acceptance_length']:.4f} (project), difference {r['difference']:+.4f}; "
          f"{r['prompts']} prompts, k={r['k']}; output equals greedy: vLLM {r['vllm_matches_greedy']}, "
          f"project {r['project_matches_greedy']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
