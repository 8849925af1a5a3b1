"""A drafter's acceptance measured by vLLM serving the target with the drafter's vLLM export.

The project's own decoder (:mod:`eagle3_assets.drafter.spec_decode`) measures acceptance by chain
speculative decoding against transformers; this module asks a real engine the same question: a
vLLM server started with ``--speculative-config '{"method": "eagle3", "model": <export>, ...}'``
decodes the held-out prompts greedily, and its Prometheus counters (``/metrics``, read before and
after) give drafts, draft tokens and accepted tokens. Acceptance length in SGLang's convention is
``1 + accepted / drafts`` (accepted draft tokens + the bonus token per verification step), the
figure the project's evaluator reports. Both count drafts accepted past ``max_tokens`` on the last
step, so the two figures are comparable as they stand. The outputs are also compared with plain
greedy decoding: speculation must not change them.

``python -m eagle3_assets.drafter.vllm_acceptance demo`` measures a trained recipe's export on
the recipe's held-out prompts and prints it next to the project's figure (``eval.json``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

SPEC_PREFIX = "vllm:spec_decode_"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def parse_prometheus(text: str, prefix: str = SPEC_PREFIX) -> dict[str, float]:
    """``{"name{labels}": value}`` for the samples whose name starts with ``prefix``, summed over
    label sets that differ only by ``model_name``/``engine`` (one engine here)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        keep = [p for p in labels.strip("{}").split(",") if p and p.split("=")[0] in ("position",)]
        key = name + ("{" + ",".join(keep) + "}" if keep else "")
        out[key] = out.get(key, 0.0) + value
    return out


def _counter(metrics: dict, name: str) -> float:
    for key in (f"{SPEC_PREFIX}{name}_total", f"{SPEC_PREFIX}{name}"):
        if key in metrics:
            return metrics[key]
    raise KeyError(f"{SPEC_PREFIX}{name}_total is not among the server's metrics: is speculative decoding on?")


@dataclass
class EngineAcceptance:
    """What vLLM's counters say about one batch of prompts."""

    k: int
    prompts: int
    drafts: int  # verification steps that had drafts
    draft_tokens: int
    accepted_tokens: int
    acceptance_length: float  # 1 + accepted / drafts (SGLang's convention)
    acceptance_length_no_bonus: float
    per_position_rate: list[float]  # accepted at position j / drafts
    output_tokens: int
    matches_greedy: bool | None = None
    outputs: list[list[int]] = field(default_factory=list)

    def as_metadata(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "outputs"}


def acceptance_from_counters(before: dict, after: dict, k: int) -> dict:
    drafts = int(_counter(after, "num_drafts") - _counter(before, "num_drafts"))
    draft_tokens = int(_counter(after, "num_draft_tokens") - _counter(before, "num_draft_tokens"))
    accepted = int(_counter(after, "num_accepted_tokens") - _counter(before, "num_accepted_tokens"))
    per_pos = []
    for j in range(k):
        key = f'{SPEC_PREFIX}num_accepted_tokens_per_pos_total{{position="{j}"}}'
        if key in after:
            per_pos.append((after[key] - before.get(key, 0.0)) / drafts if drafts else 0.0)
    return {"drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "acceptance_length_no_bonus": accepted / drafts if drafts else 0.0, "per_position_rate": per_pos}


def measure_acceptance(api_url: str, prompts: Sequence[Sequence[int]], *, k: int, max_new_tokens: int,
                       model: str = "", concurrency: int = 8, greedy_reference: Sequence[Sequence[int]] | None = None,
                       timeout_s: float = 1800.0, stop_token_ids: Sequence[int] = ()) -> EngineAcceptance:
    """Greedy completions of ``prompts`` (token ids) from a speculating vLLM server at ``api_url``
    (``.../v1``); the counters' difference over this batch is its acceptance. Nothing else may use
    the server meanwhile. ``stop_token_ids``: the target's end of turn (and eos ids), which vLLM
    does not stop on by itself when the config's ``eos_token_id`` is another id (Kimi-K2.5)."""
    import httpx

    root = api_url.rstrip("/").removesuffix("/v1")
    with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=30.0)) as client:
        if not model:
            model = client.get(api_url + "/models").json()["data"][0]["id"]

        def metrics() -> dict:
            r = client.get(root + "/metrics")
            r.raise_for_status()
            return parse_prometheus(r.text)

        def complete(ids) -> list[int]:
            body = {"model": model, "prompt": [int(t) for t in ids], "max_tokens": max_new_tokens,
                    "temperature": 0.0, "return_token_ids": True}
            if stop_token_ids:
                body["stop_token_ids"] = [int(t) for t in stop_token_ids]
            r = client.post(api_url + "/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"{api_url}/completions answered {r.status_code}: {r.text[:300]}")
            return [int(t) for t in r.json()["choices"][0]["token_ids"]]

        before = metrics()
        with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(prompts)))) as pool:
            outputs = list(pool.map(complete, prompts))
        after = metrics()
    figures = acceptance_from_counters(before, after, k)
    rep = EngineAcceptance(k=k, prompts=len(prompts), output_tokens=sum(map(len, outputs)), outputs=outputs, **figures)
    if greedy_reference is not None:
        rep.matches_greedy = outputs == [list(g) for g in greedy_reference]
    return rep


def compare(project: dict, engine: EngineAcceptance, name: str = "vllm") -> dict:
    """The project's evaluator (``eval.json['trained']`` or an ``AcceptanceReport.as_metadata()``)
    next to an engine's counters (``name``: vllm or sglang, the keys' prefix)."""
    a, b = float(project["acceptance_length"]), engine.acceptance_length
    return {"project_acceptance_length": round(a, 4), f"{name}_acceptance_length": round(b, 4),
            "difference": round(b - a, 4), "project_per_position": [round(x, 4) for x in project.get("per_position_rate", [])],
            f"{name}_per_position": [round(x, 4) for x in engine.per_position_rate],
            "project_matches_greedy": project.get("matches_greedy"), f"{name}_matches_greedy": engine.matches_greedy,
            f"{name}_verify_steps": engine.drafts, "project_verify_steps": project.get("verify_steps")}


def measure_recipe(recipe_name: str, *, python: str | None = None, layout=None, trust_remote_code: bool = False) -> dict:
    """Serve a trained recipe's vLLM export next to its target, measure acceptance on the recipe's
    held-out prompts, compare with ``eval.json``; written to ``drafters/<recipe>/vllm_acceptance.json``.
    ``trust_remote_code``: the target's tokenizer is code (Kimi), read for its end of turn."""
    from eagle3_assets.drafter.evaluate import eval_prompts
    from eagle3_assets.drafter.recipes import load_recipe
    from eagle3_assets.paths import DataLayout
    from eagle3_assets.target.catalog import resolve_model_dir
    from eagle3_assets.target.vllm_server import VLLMServer

    layout = layout or DataLayout.from_env()
    recipe = load_recipe(recipe_name)
    out = layout.drafter_dir(recipe.name)
    ev_path = out / "eval.json"
    if not ev_path.exists() or not (out / "vllm" / "config.json").exists():
        raise FileNotFoundError(f"{out}: no trained drafter (eval.json and vllm/): materialize drafter_checkpoint[{recipe.name}]")
    ev = json.loads(ev_path.read_text())
    trained_on = json.loads((out / "job.json").read_text()).get("target", {}).get("model_dir")
    model_dir = Path(trained_on or resolve_model_dir("", layout.models_dir))
    prompts = eval_prompts(layout, recipe.datasets, recipe.evaluation.eval_samples)
    stops = _stop_ids(model_dir, trust_remote_code)
    greedy = _greedy(model_dir, prompts, recipe.evaluation.eval_max_new_tokens, stops)
    with VLLMServer(model_dir, role="speculate", drafter_dir=out / "vllm", num_speculative_tokens=ev["k"],
                    python=python or "") as server:
        engine = measure_acceptance(server.api_url, prompts, k=ev["k"], max_new_tokens=ev["max_new_tokens"],
                                    greedy_reference=greedy, stop_token_ids=stops)
    result = {**compare(ev["trained"], engine), "recipe": recipe.name, "prompts": len(prompts), "k": ev["k"],
              "max_new_tokens": ev["max_new_tokens"], "engine": engine.as_metadata()}
    (out / "vllm_acceptance.json").write_text(json.dumps(result, indent=2))
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
