"""How the drafter-quality benchmark scores a row: the target's greedy replies and replay inputs
(computed once for all rows and cached under ``<root>/results``), the replay evaluator on a row's
export and on its kept checkpoints, and a real vLLM server's own acceptance counters. Shared by
``drafter_quality.py`` and ``reference_row.py``; SGLang's EAGLE-3 worker's counters likewise (``sglang_row``)."""

from __future__ import annotations

import json
import time
from pathlib import Path


def greedy_reference(root: Path, layout, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Plain greedy decoding of the held-out prompts by the HF target, computed once for all rows."""
    path = root / "results" / f"greedy-{max_new_tokens}.json"
    if path.exists():
        cached = json.loads(path.read_text())
        if cached["prompts"] == prompts:
            return cached["outputs"]
    from eagle3_assets.drafter.vllm_acceptance import _greedy, _stop_ids
    from eagle3_assets.target.embedded import ensure_default_model

    model_dir = ensure_default_model(layout.models_dir)
    outputs = _greedy(model_dir, prompts, max_new_tokens, _stop_ids(model_dir, False))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"prompts": prompts, "outputs": outputs}))
    return outputs


def replay_items(root: Path, layout, prompts: list[list[int]], max_new_tokens: int, layer_ids: list[int]):
    """The target's part of the replay evaluator for the held-out prompts (one prefill each over
    prompt + greedy reply, 8 greedy tokens past it), computed once for all rows."""
    import torch

    path = root / "results" / f"replay-{max_new_tokens}.pt"
    if path.exists():
        cached = torch.load(path, weights_only=False)
        if cached["prompts"] == prompts and cached["layer_ids"] == layer_ids:
            return cached["items"]
    from eagle3_assets.drafter.replay_acceptance import replay_inputs
    from eagle3_assets.target.embedded import ensure_default_model
    from eagle3_assets.target.loading import load_causal_lm

    greedy = greedy_reference(root, layout, prompts, max_new_tokens)
    target = load_causal_lm(ensure_default_model(layout.models_dir))
    items = replay_inputs(target, prompts, greedy, layer_ids, lookahead=REPLAY_LOOKAHEAD)
    torch.save({"prompts": prompts, "layer_ids": layer_ids, "items": items}, path)
    return items


REPLAY_LOOKAHEAD = 8  # greedy tokens past each reply: enough for any k <= 8


def replay_row(root: Path, name: str) -> dict:
    """The replay evaluator (``drafter/replay_acceptance.py``: exact, seconds) on the row's export
    and on an untrained drafter of the same shape (the floor every row is read against)."""
    import time as _t

    from eagle3_assets.drafter.evaluate import eval_prompts, load_export
    from eagle3_assets.drafter.recipes import load_recipe
    from eagle3_assets.drafter.replay_acceptance import replay_acceptance
    from eagle3_assets.drafter.spec_decode import untrained_baseline
    from eagle3_assets.drafter.target_weights import read_target_embeddings
    from eagle3_assets.drafter.vllm_acceptance import _stop_ids
    from eagle3_assets.paths import DataLayout
    from eagle3_assets.target.embedded import ensure_default_model

    layout = DataLayout.from_env()
    recipe = load_recipe(name)
    ev = recipe.evaluation
    model_dir = ensure_default_model(layout.models_dir)
    drafter = load_export(layout.drafter_dir(name), read_target_embeddings(model_dir)).float().eval()
    prompts = eval_prompts(layout, recipe.datasets, ev.eval_samples)
    items = replay_items(root, layout, prompts, ev.eval_max_new_tokens, drafter.config.aux_layer_ids)
    out = {}
    for which, model in (("trained", drafter), ("untrained", untrained_baseline(drafter, seed=recipe.training.seed + 1))):
        t0 = _t.perf_counter()
        rep = replay_acceptance(model, items, k=ev.speculative_k, max_new_tokens=ev.eval_max_new_tokens,
                                stop_ids=_stop_ids(model_dir, False))
        out[which] = {**rep.as_metadata(), "seconds": round(_t.perf_counter() - t0, 1)}
    return {**out, "prompts": len(prompts), "k": ev.speculative_k, "max_new_tokens": ev.eval_max_new_tokens,
            "greedy_mismatches": sum(i.greedy_mismatches for i in items), "evaluator": "replay"}


def checkpoint_curve(root: Path, name: str) -> list[dict]:
    """Acceptance length by the replay evaluator at every kept checkpoint of the row (its fp32
    weights; the last point is the end of training; the export is the point with the best estimate,
    in bf16), next to the acceptance estimate the trainer logged there (``eal``)."""
    from eagle3_assets.drafter.evaluate import eval_prompts
    from eagle3_assets.drafter.model import DrafterConfig, Eagle3Drafter
    from eagle3_assets.drafter.recipes import load_recipe
    from eagle3_assets.drafter.replay_acceptance import replay_acceptance
    from eagle3_assets.drafter.target_weights import read_target_embeddings
    from eagle3_assets.drafter.training.checkpoints import checkpoints_dir, load_checkpoint
    from eagle3_assets.drafter.vllm_acceptance import _stop_ids
    from eagle3_assets.paths import DataLayout
    from eagle3_assets.target.embedded import ensure_default_model

    layout = DataLayout.from_env()
    recipe = load_recipe(name)
    ev = recipe.evaluation
    out = layout.drafter_dir(name)
    trained = json.loads((out / "result.json").read_text())
    per_epoch = trained["batches_per_epoch"]
    eal = {e["step"]: e["eal"] for e in trained.get("acceptance_estimates") or []}  # the trainer's, per checkpoint
    model_dir = ensure_default_model(layout.models_dir)
    embeddings, stops = read_target_embeddings(model_dir), _stop_ids(model_dir, False)
    prompts = eval_prompts(layout, recipe.datasets, ev.eval_samples)
    curve = []
    for path in sorted(checkpoints_dir(out).glob("step-*.pt")):
        state = load_checkpoint(path)
        drafter = Eagle3Drafter(DrafterConfig.from_dict(state["drafter_config"])).set_embeddings(embeddings)
        drafter.load_state_dict(state["model"], strict=False)
        items = replay_items(root, layout, prompts, ev.eval_max_new_tokens, drafter.config.aux_layer_ids)
        rep = replay_acceptance(drafter.float().eval(), items, k=ev.speculative_k,
                                max_new_tokens=ev.eval_max_new_tokens, stop_ids=stops)
        curve.append({"step": state["step"], "epoch": round(state["epoch"] + state["batch_in_epoch"] / per_epoch, 2),
                      "acceptance_length": round(rep.acceptance_length, 4), "eal": eal.get(state["step"]),
                      "train_loss": round(state["metrics"][-1]["loss"], 4)})
    return curve


def vllm_row(root: Path, name: str, ev: dict) -> dict:
    """The row's vLLM export served next to the target by a real vLLM server; its counters'
    acceptance on the same held-out prompts, decoded as long as the project's evaluator did."""
    from eagle3_assets.drafter.evaluate import eval_prompts
    from eagle3_assets.drafter.recipes import load_recipe
    from eagle3_assets.engines.vllm.acceptance import measure_acceptance
    from eagle3_assets.engines.vllm.server import VLLMServer, vllm_available
    from eagle3_assets.paths import DataLayout
    from eagle3_assets.target.embedded import ensure_default_model

    if not vllm_available():
        return {"skipped": "no .venv-vllm (make vllm)"}
    layout = DataLayout.from_env()
    recipe = load_recipe(name)
    export = layout.drafter_dir(name) / "vllm"
    if not (export / "config.json").exists():
        return {"skipped": "the recipe writes no vLLM export"}
    prompts = eval_prompts(layout, recipe.datasets, recipe.evaluation.eval_samples)
    greedy = greedy_reference(root, layout, prompts, ev["max_new_tokens"])
    t0 = time.perf_counter()
    with VLLMServer(ensure_default_model(layout.models_dir), role="speculate", drafter_dir=export,
                    num_speculative_tokens=ev["k"]) as server:
        ready = time.perf_counter() - t0
        eng = measure_acceptance(server.api_url, prompts, k=ev["k"], max_new_tokens=ev["max_new_tokens"],
                                 greedy_reference=greedy)
    return {**eng.as_metadata(), "server_start_s": round(ready, 1), "seconds": round(time.perf_counter() - t0, 1)}


def sglang_row(root: Path, name: str, ev: dict) -> dict:
    """The row's SGLang export served next to the target by SGLang's own EAGLE-3 worker (CPU engine,
    intel_amx backend on the project's CPU kernels); its per-request counters' acceptance on the same
    held-out prompts. Rows whose layout SGLang does not serve (norm before fc) write no SGLang export."""
    from eagle3_assets.drafter.evaluate import eval_prompts
    from eagle3_assets.drafter.recipes import load_recipe
    from eagle3_assets.engines.sglang.acceptance import measure_acceptance
    from eagle3_assets.engines.sglang.server import SGLangServer, sglang_available
    from eagle3_assets.paths import DataLayout
    from eagle3_assets.target.embedded import ensure_default_model

    if not sglang_available():
        return {"skipped": "no .venv-sglang (make sglang)"}
    layout = DataLayout.from_env()
    recipe = load_recipe(name)
    export = layout.drafter_dir(name) / "sglang"
    if not (export / "config.json").exists():
        return {"skipped": "the recipe writes no SGLang export (a layout SGLang does not serve)"}
    prompts = eval_prompts(layout, recipe.datasets, recipe.evaluation.eval_samples)
    greedy = greedy_reference(root, layout, prompts, ev["max_new_tokens"])
    t0 = time.perf_counter()
    with SGLangServer(ensure_default_model(layout.models_dir), attention_backend="intel_amx", drafter_dir=export,
                      speculative_steps=ev["k"]) as server:
        ready = time.perf_counter() - t0
        eng = measure_acceptance(server.base_url, prompts, k=ev["k"], max_new_tokens=ev["max_new_tokens"],
                                 greedy_reference=greedy)
    return {**eng.as_metadata(), "server_start_s": round(ready, 1), "seconds": round(time.perf_counter() - t0, 1)}
