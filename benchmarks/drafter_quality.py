"""Drafter quality from one prompt file: an ablation table of training recipes, both AL figures per row.

From the prompt file (default ``../shared/data/drafter_quality_prompts.jsonl``, 260 prompts) through
the project's own stages in a real Dagster instance under ``--root``: ``prompts -> raw_responses
(embedded target) -> token_ids -> inventory -> merged_corpus -> hidden_states``, once per data
variant (greedy replies, several sampled replies per prompt), cached on disk between rows and runs.
The corpus split hashes the prompt id, so every data variant holds out the same prompts, and no
row ever trains on a held-out prompt.

Each row is one training recipe (``VARIANTS``: today's recipe, each lever alone, combinations),
materialized as ``drafter_checkpoint[<row>]`` (trainer through Dagster Pipes, exports, the
project's evaluator on every held-out prompt), in a fresh process so its peak RSS is its own; then,
when ``.venv-vllm`` exists, a real vLLM server serves the row's vLLM export next to the target and
its own counters give the second acceptance length on the same prompts. Printed per row: AL by the
project's evaluator and by vLLM (k=3 chain, greedy), per-position acceptance, training tokens/s,
training and row wall time, peak RSS.

``--reference`` (or the ``reference`` command) also trains vLLM's ``speculators`` 0.9.0 on the
same train split in its own environment (``--reference-python``; ``bash
benchmarks/reference_env.sh`` builds it), scores it with the same evaluators and caches it as
``results/reference_speculators.json`` (``benchmarks/reference_row.py``); without that
environment it says why in one line.

Run (every heavy piece under the shared lock on a shared box):

    flock /tmp/eagle3-cpu.lock .venv/bin/python benchmarks/drafter_quality.py data
    flock /tmp/eagle3-cpu.lock .venv/bin/python benchmarks/drafter_quality.py row today
    flock /tmp/eagle3-cpu.lock .venv/bin/python benchmarks/drafter_quality.py reference
    .venv/bin/python benchmarks/drafter_quality.py table
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = REPO.parent / "shared" / "data" / "drafter_quality_prompts.jsonl"
DEFAULT_ROOT = REPO / "data" / "bench" / "drafter_quality"

# Data variants: one dataset (partition) each, all from the same prompt file. Generation settings
# are raw_responses' run config; sample ids hash them, so each variant's replies are its own.
MAX_NEW_TOKENS = 128  # the data: 260 greedy replies of at most 128 tokens, ~33k tokens
DATA = {
    "dq": {"temperature": 0.0, "samples_per_prompt": 1},  # the target's greedy reply
    "dq_t07x2": {"temperature": 0.7, "top_p": 0.95, "seed": 1, "samples_per_prompt": 2},  # 2 sampled replies
    "dq_t07x6": {"temperature": 0.7, "top_p": 0.95, "seed": 2, "samples_per_prompt": 6},  # 6 more (8 with the above)
    "dq_t1x2": {"temperature": 1.0, "top_p": 1.0, "seed": 3, "samples_per_prompt": 2},  # 2 at T 1 (temperature)
}


def setup_env(root: Path) -> None:
    """Point the project at the benchmark's own data root, instance and recipes (before any
    definitions import); the converted model is shared with the checkout's data root."""
    root.mkdir(parents=True, exist_ok=True)
    os.environ["EAGLE3_HOME"] = str(root)
    os.environ["DAGSTER_HOME"] = str(root / "dagster")
    os.environ["EAGLE3_RECIPES"] = str(root / "recipes")
    os.environ.setdefault("EAGLE3_MODEL_CACHE", str(REPO / "data" / "models"))
    for k, v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(k, v)
    (root / "recipes").mkdir(exist_ok=True)


def uptime() -> str:
    """The 1, 5 and 15 minute load averages, recorded with every figure."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def make_data(root: Path, prompts: Path, names: list[str], *, backend: str, max_samples: int = 0) -> dict:
    """Each data variant through the project's stages; what is on disk already is kept. Replies
    come from the embedded target (``local``) or from a vLLM server started here (``vllm``: about
    10x faster on CPU, and a seed per sample)."""
    import contextlib

    import dagster as dg

    from eagle3_assets.paths import DataLayout, ensure_dagster_home

    layout = DataLayout.from_env()
    ensure_dagster_home(layout)
    from eagle3_assets.definitions import ALL_ASSETS, ALL_CHECKS, DATA_ASSETS, default_resources
    from eagle3_assets.launch import materialize_selection
    from eagle3_assets.partitions import datasets_partitions
    from eagle3_assets.target.embedded import ensure_default_model
    from eagle3_assets.target.vllm_server import VLLMServer
    from resources import VLLMResource

    instance = dg.DagsterInstance.get()
    known = set(instance.get_dynamic_partitions(datasets_partitions.name))
    instance.add_dynamic_partitions(datasets_partitions.name, [n for n in names if n not in known])
    todo = [n for n in names if not (layout.hidden_states_dir(n) / "manifest.json").exists()]
    server = contextlib.nullcontext()
    if todo and backend == "vllm":
        server = VLLMServer(ensure_default_model(layout.models_dir), role="generate", max_model_len=2048,
                            env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})  # both cores compute
    report, seconds, complete = {}, {}, []
    with server:  # phase 1: every variant's replies and corpus while the server is up
        resources = default_resources()
        if backend == "vllm" and todo:
            resources["vllm"] = VLLMResource(base_urls=[server.api_url], endpoint="completions")
        for name in names:
            layout.prompts_dir.mkdir(parents=True, exist_ok=True)
            dst = layout.prompt_source(name)
            if not dst.exists():
                shutil.copyfile(prompts, dst)
            t0 = time.perf_counter()
            if name in todo:
                gen = {"backend": backend, "max_new_tokens": MAX_NEW_TOKENS, "batch_size": 16, "concurrency": 32,
                       "max_samples": max_samples, **DATA[name]}
                result = dg.materialize([*ALL_ASSETS, *ALL_CHECKS], selection=[a.key for a in DATA_ASSETS],
                                        partition_key=name, instance=instance, resources=resources, raise_on_error=False,
                                        run_config={"ops": {"raw_responses": {"config": gen}}})
                if not result.success:
                    raise SystemExit(f"{name}: the dataset pipeline failed (run {result.run_id})")
                planned = sum(1 for _ in open(dst, encoding="utf-8") if _.strip()) * DATA[name]["samples_per_prompt"]
                have = sum(v["samples"] for v in corpus_figures(layout, name).values())
                if have < planned:
                    print(f"data {name}: {have}/{planned} samples so far; run again to continue", flush=True)
                    continue
            seconds[name] = time.perf_counter() - t0
            complete.append(name)
    # phase 2: hidden states once the server is stopped and its memory back
    for name in complete:
        t0 = time.perf_counter()
        if name in todo:
            result = materialize_selection(instance, ["hidden_states"], name, {"ops": {"hidden_states": {"config": {}}}})
            if not result.success:
                raise SystemExit(f"{name}: hidden_states failed (run {result.run_id})")
        seconds[name] += time.perf_counter() - t0
        report[name] = {**corpus_figures(layout, name), "seconds": round(seconds[name], 1)}
        print(f"data {name}: {json.dumps(report[name])} load {uptime()}", flush=True)
    return report


def corpus_figures(layout, name: str) -> dict:
    import polars as pl

    c = pl.read_parquet(layout.corpus(name), columns=["prompt_id", "split", "input_ids", "prompt_len"])
    resp = c.with_columns((pl.col("input_ids").list.len() - pl.col("prompt_len")).alias("resp"))
    out = {}
    for split in ("train", "eval"):
        s = resp.filter(pl.col("split") == split)
        out[split] = {"samples": s.height, "prompts": s["prompt_id"].n_unique(), "response_tokens": int(s["resp"].sum()),
                      "tokens": int(s["input_ids"].list.len().sum())}
    return out


# ----------------------------------------------------------------------------- rows (training recipes)

# Today's recipe with the reference trainer's knobs matched where this trainer has them (draft
# vocab 8192, 3 TTT steps at equal weight, intermediate 1536, 13 epochs at lr 1e-3), evaluated on
# every held-out prompt: whole replies (up to MAX_NEW_TOKENS generated tokens), k=3 chain, greedy.
BASE = {
    "datasets": {"dq": 1.0}, "draft_vocab_size": 8192, "intermediate_size": 1536,
    "ttt_steps": 3, "step_loss_decay": 1.0, "feature_noise": 0.0, "lr": 1e-3, "epochs": 13, "batch_size": 8, "max_length": 2048,
    "warmup_steps": 0, "schedule": "cosine", "checkpoint_every": 1000,
    # drafter_acceptance's bar: every row must beat the untrained twin this script measures on the same
    # prompts (1.0 here: nothing accepted) by 0.5, and reach 1.5 (a floor of 1.0 passed an untrained drafter)
    "acceptance_floor": 1.5, "acceptance_margin": 0.5,
    "eval_samples": 1000, "eval_max_new_tokens": MAX_NEW_TOKENS, "speculative_k": 3,
}
# row -> (what it changes, overrides of BASE). Rows on more data keep today's number of steps
# unless they say otherwise, so a row's gain is the lever's and not more compute.
GREEDY_AND_8 = {"dq": 1.0, "dq_t07x2": 1.0, "dq_t07x6": 1.0}  # 1 greedy + 8 sampled replies per prompt
VARIANTS = {
    "today": ("today's trainer, matched recipe", {}),
    "replies": ("+ 2 sampled replies per prompt (T 0.7, top-p 0.95) next to the greedy one, same steps",
                {"datasets": {"dq": 1.0, "dq_t07x2": 1.0}, "epochs": 4.33}),
    "replies8": ("+ 8 sampled replies per prompt next to the greedy one, same steps",
                 {"datasets": GREEDY_AND_8, "epochs": 1.44}),
    "head": ("+ draft head and final norm start as the target's", {"init_head_from_target": True}),
    "head_frozen": ("+ draft head and final norm are the target's, frozen",
                    {"init_head_from_target": True, "freeze_head": True}),
    "noise": ("+ feature noise, uniform +-0.1 x token RMS", {"feature_noise": 0.1}),
    "noise03": ("+ feature noise, uniform +-0.3 x token RMS", {"feature_noise": 0.3}),
    "lk": ("loss: LK blend of KL and TV", {"loss": "lk"}),
    "tv": ("loss: total variation", {"loss": "tv"}),
    "norm_fc": ("+ RMSNorm before fc (vLLM only)", {"norm_before_fc": True, "engines": ["vllm"]}),
    "ttt5": ("5 TTT steps", {"ttt_steps": 5}),
    "muon": ("optimizer: Muon on the matrices", {"optimizer": "muon"}),
    "lr": ("lr 3e-3, 20 warmup steps", {"lr": 3e-3, "warmup_steps": 20}),
    "epochs26": ("26 epochs (twice the steps)", {"epochs": 26}),
    "wide": ("intermediate 3072", {"intermediate_size": 3072}),
    "replies8_noise_e3": ("1 greedy + 8 sampled replies per prompt, feature noise 0.1, 3 epochs (2x today's steps)",
                          {"datasets": GREEDY_AND_8, "feature_noise": 0.1, "epochs": 3}),
    "levers": ("+ every lever measured to help alone: feature noise 0.1, RMSNorm before fc, lr 3e-3 "
               "with 20 warmup steps (vLLM only)",
               {"feature_noise": 0.1, "norm_before_fc": True, "engines": ["vllm"], "lr": 3e-3, "warmup_steps": 20}),
    "noise_norm_fc": ("+ feature noise 0.1 and RMSNorm before fc (vLLM only)",
                      {"feature_noise": 0.1, "norm_before_fc": True, "engines": ["vllm"]}),
    "replies8_noise_norm_fc_e3": ("1 greedy + 8 sampled replies per prompt, feature noise 0.1, RMSNorm before fc, "
                                  "3 epochs (2x today's steps; vLLM only)",
                                  {"datasets": GREEDY_AND_8, "feature_noise": 0.1, "norm_before_fc": True,
                                   "engines": ["vllm"], "epochs": 3}),
    "replies8_noise_norm_fc_e3_seed1": ("replies8_noise_norm_fc_e3 with seed 1 (initialisation, batch order, noise draws)",
                                        {"datasets": GREEDY_AND_8, "feature_noise": 0.1, "norm_before_fc": True,
                                         "engines": ["vllm"], "epochs": 3, "seed": 1}),
    "replies8_noise_frozen_e3": ("1 greedy + 8 sampled replies per prompt, feature noise 0.1, the target's head and "
                                 "final norm frozen, 3 epochs (2x today's steps)",
                                 {"datasets": GREEDY_AND_8, "feature_noise": 0.1, "init_head_from_target": True,
                                  "freeze_head": True, "epochs": 3}),
}


def row_name(name: str, scale: float) -> str:
    """The row's recipe (partition) and result name: a screening run carries its scale."""
    return name if scale == 1.0 else f"{name}_s{scale:g}"


def recipe_table(name: str, scale: float = 1.0) -> dict:
    """The row's recipe; ``scale`` < 1 shortens it (a screening run: epochs and warmup scaled)."""
    table = {**BASE, **VARIANTS[name][1], "description": VARIANTS[name][0]}
    if scale != 1.0:
        table["epochs"] = round(table["epochs"] * scale, 4)
        table["warmup_steps"] = int(table["warmup_steps"] * scale)
        table["description"] += f" (screening: {scale:g}x the epochs)"
    return table


def write_recipe(root: Path, name: str, scale: float = 1.0, out_name: str | None = None, curve: bool = False) -> Path:
    """The row's recipe as a TOML file under the benchmark's recipes folder; ``curve`` keeps
    about ``CURVE_POINTS`` checkpoints for :func:`checkpoint_curve`."""
    table = recipe_table(name, scale)
    if curve:
        table.update(curve_schedule(table))
    lines = [f"{k} = {toml_value(v)}" for k, v in table.items() if k != "datasets"]
    lines.append("[datasets]")
    lines += [f"{d} = {float(w)}" for d, w in table["datasets"].items()]
    path = root / "recipes" / f"{out_name or row_name(name, scale)}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v)


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


def train_row(name: str, threads: int) -> dict:
    """(In a fresh process.) drafter_checkpoint[name] in the benchmark's instance: the trainer
    through Pipes, the exports, the project's evaluator on every held-out prompt."""
    import dagster as dg

    from eagle3_assets.launch import materialize_selection
    from eagle3_assets.paths import DataLayout

    layout = DataLayout.from_env()
    out = layout.drafter_dir(name)
    shutil.rmtree(out, ignore_errors=True)  # one run per row, from scratch
    t0 = time.perf_counter()
    result = materialize_selection(dg.DagsterInstance.get(), ["drafter_checkpoint"], name,
                                   {"ops": {"drafter_checkpoint": {"config": {"threads": threads}}}})
    wall = time.perf_counter() - t0
    if not result.success:
        raise SystemExit(f"drafter_checkpoint[{name}] failed (run {result.run_id})")
    trained, ev = json.loads((out / "result.json").read_text()), json.loads((out / "eval.json").read_text())
    checks = {c.check_name: c.passed for c in result.get_asset_check_evaluations()}
    return {"train": trained, "eval": ev, "row_wall_s": wall, "checks": checks,
            "trainer_peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
            "row_process_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


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


def fit_row(root: Path, name: str, threads: int, piece_steps: int) -> dict:
    """(In a fresh process.) One row: the trainer entry point on the recipe's job file, as the
    asset launches it, at most ``piece_steps`` more optimizer steps per call (0: to the end; the
    trainer resumes from its checkpoint), then the replay evaluator on the exported drafter."""
    from eagle3_assets.drafter.recipes import load_recipe
    from eagle3_assets.drafter.training.checkpoints import latest_checkpoint, load_checkpoint
    from eagle3_assets.drafter.training.config import ExportSettings, RuntimeSettings, TrainJob
    from eagle3_assets.paths import DataLayout
    from eagle3_assets.target.embedded import ensure_default_model

    layout = DataLayout.from_env()
    recipe = load_recipe(name)
    out = layout.drafter_dir(name)
    ckpt = latest_checkpoint(out) if out.exists() else None
    done = load_checkpoint(ckpt)["step"] if ckpt else 0
    if ckpt is None:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    job = TrainJob(target_dir=str(ensure_default_model(layout.models_dir)), out_dir=str(out),
                   datasets={str(layout.hidden_states_dir(d)): w for d, w in recipe.datasets.items()},
                   training=recipe.training, shape=recipe.shape,
                   runtime=RuntimeSettings(threads=threads, progress=False,
                                           stop_after=done + piece_steps if piece_steps else None),
                   export=ExportSettings(sglang="sglang" in recipe.shape.engines, vllm="vllm" in recipe.shape.engines))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "eagle3_assets.drafter.training", "--config", str(job.write(out / "job.json"))],
                   check=True, stdout=subprocess.DEVNULL)
    trained = json.loads((out / "result.json").read_text())
    wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    if trained.get("stopped_early"):
        return {"partial": True, "steps": trained["steps"], "total_steps": trained["total_steps"], "piece_s": wall}
    return {"train": trained, "row_wall_s": time.perf_counter() - t0, "trainer_peak_rss_mib": rss,
            "eval": replay_row(root, name), "curve": checkpoint_curve(root, name)}


CURVE_POINTS = 10  # checkpoints per row scored by the replay evaluator (acceptance over training)


def curve_schedule(table: dict) -> dict:
    """``checkpoint_every`` and ``keep_checkpoints`` for about ``CURVE_POINTS`` scored checkpoints
    over the row's run (neither changes the trained weights)."""
    from eagle3_assets.paths import DataLayout

    layout = DataLayout.from_env()
    samples = sum(w * corpus_figures(layout, d)["train"]["samples"] for d, w in table["datasets"].items())
    total = math.ceil(table["epochs"] * math.ceil(samples / table["batch_size"]))
    return {"checkpoint_every": max(1, total // CURVE_POINTS), "keep_checkpoints": CURVE_POINTS + 2}


def checkpoint_curve(root: Path, name: str) -> list[dict]:
    """Acceptance length by the replay evaluator at every kept checkpoint of the row (its fp32
    weights; the last point is the end of training, which the exported bf16 drafter rounds)."""
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
    per_epoch = json.loads((out / "result.json").read_text())["batches_per_epoch"]
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
                      "acceptance_length": round(rep.acceptance_length, 4),
                      "train_loss": round(state["metrics"][-1]["loss"], 4)})
    return curve


def vllm_row(root: Path, name: str, ev: dict) -> dict:
    """The row's vLLM export served next to the target by a real vLLM server; its counters'
    acceptance on the same held-out prompts, decoded as long as the project's evaluator did."""
    from eagle3_assets.drafter.evaluate import eval_prompts
    from eagle3_assets.drafter.recipes import load_recipe
    from eagle3_assets.drafter.vllm_acceptance import measure_acceptance
    from eagle3_assets.paths import DataLayout
    from eagle3_assets.target.embedded import ensure_default_model
    from eagle3_assets.target.vllm_server import VLLMServer, vllm_available

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


def run_row(root: Path, name: str, *, threads: int, vllm: bool, force: bool, scale: float = 1.0,
            piece_steps: int = 0) -> dict:
    rname = row_name(name, scale)
    path = root / "results" / f"{rname}.json"
    if path.exists() and not force:
        print(f"row {rname}: cached in {path} (--force to rerun)")
        return json.loads(path.read_text())
    write_recipe(root, name, scale, curve=True)
    load0 = uptime()
    while True:  # in pieces of --piece-steps steps, each resuming the last checkpoint
        res = subprocess.run([sys.executable, __file__, "_fit", rname, "--root", str(root), "--threads", str(threads),
                              "--piece-steps", str(piece_steps)], capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(f"row {rname} failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
        row = json.loads(res.stdout.strip().splitlines()[-1])
        if not row.get("partial"):
            break
        print(f"row {rname}: {row['steps']}/{row['total_steps']} steps ({row['piece_s']:.0f} s this piece)", flush=True)
    table = recipe_table(name, scale)
    row.update(name=rname, description=table["description"], recipe=table, load_before=load0,
               load_after_training=uptime(), finished_at=time.strftime("%Y-%m-%d %H:%M:%S"))
    row["vllm"] = vllm_row(root, rname, row["eval"]) if vllm else {"skipped": "not measured (--no-vllm)"}
    row["load_after"] = uptime()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(row, indent=2))
    print(f"row {rname}: {line(row)}", flush=True)
    return row


def run_final(root: Path, name: str, *, threads: int) -> dict:
    """A row end to end through Dagster: ``drafter_checkpoint[<row>_asset]`` materialized in the
    benchmark's instance (trainer through Pipes, exports, the real chain decoder on every held-out
    prompt, the ``drafter_acceptance`` check), then vLLM on its export; the replay evaluator on the
    same export is printed beside the decoder, which it must equal."""
    rname = f"{name}_asset"
    table = recipe_table(name)
    write_recipe(root, name, out_name=rname)
    load0 = uptime()
    res = subprocess.run([sys.executable, __file__, "_train", rname, "--root", str(root), "--threads", str(threads)],
                         capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"final {rname} failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
    row = json.loads(res.stdout.strip().splitlines()[-1])
    row.update(name=rname, description=table["description"] + " (through the asset, real decoder)", recipe=table,
               load_before=load0, finished_at=time.strftime("%Y-%m-%d %H:%M:%S"), replay=replay_row(root, rname))
    row["vllm"] = vllm_row(root, rname, row["eval"])
    path = root / "results" / f"{rname}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(row, indent=2))
    print(f"final {rname}: {line(row)}; replay evaluator {row['replay']['trained']['acceptance_length']:.3f}; "
          f"checks {row['checks']}", flush=True)
    return row


def line(row: dict) -> str:
    t, v, tr = row["eval"]["trained"], row["vllm"], row["train"]
    vl = f"{v['acceptance_length']:.3f}" if "acceptance_length" in v else "-"
    return (f"AL {t['acceptance_length']:.3f} (vLLM {vl}), per position "
            f"{' '.join(f'{x:.2f}' for x in t['per_position_rate'])}, {tr['tokens_per_s']:.0f} tok/s, "
            f"train {tr['wall_s']:.0f}s, row {row['row_wall_s']:.0f}s, trainer peak RSS {row['trainer_peak_rss_mib']:.0f} MiB"
            + ("; over training (epoch: AL) " + ", ".join(f"{c['epoch']:g}: {c['acceptance_length']:.3f}" for c in row["curve"])
               if row.get("curve") else ""))


def speed_once(root: Path, mode: str, steps: int, threads: int) -> dict:
    """(In a fresh process.) The BASE recipe's first ``steps`` optimizer steps on ``dq``, packed
    (the trainer) or padded (the yardstick: every padded position computed, teacher included)."""
    from eagle3_assets.drafter.training.config import RuntimeSettings, TrainJob
    from eagle3_assets.drafter.training.job import run_job
    from eagle3_assets.paths import DataLayout
    from eagle3_assets.target.embedded import ensure_default_model

    layout = DataLayout.from_env()
    base = write_recipe(root, "today")
    from eagle3_assets.drafter.recipes import parse_recipe

    recipe = parse_recipe(base)
    out = root / "speed" / mode
    shutil.rmtree(out, ignore_errors=True)
    job = TrainJob(target_dir=str(ensure_default_model(layout.models_dir)), out_dir=str(out),
                   datasets={str(layout.hidden_states_dir(d)): w for d, w in recipe.datasets.items()},
                   training=recipe.training.model_copy(update={"max_steps": steps, "epochs": None}), shape=recipe.shape,
                   runtime=RuntimeSettings(threads=threads, progress=False, packed=mode == "packed"), export=None)
    losses = []
    summary = run_job(job, on_metrics=lambda m: losses.append(m["loss"]))
    return {"mode": mode, "tokens_per_s": summary["tokens_per_s"], "wall_s": summary["wall_s"], "losses": losses,
            "data_share": summary["data_share"], "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def speed(root: Path, steps: int, threads: int) -> None:
    """Packed vs padded training side by side in fresh processes: tokens/s and the loss curves."""
    runs = {}
    for mode in ("padded", "packed"):
        res = subprocess.run([sys.executable, __file__, "_speed", mode, "--root", str(root), "--threads", str(threads),
                              "--steps", str(steps)], capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(res.stderr[-3000:])
        runs[mode] = json.loads(res.stdout.strip().splitlines()[-1])
        print(f"{mode:>7}: {runs[mode]['tokens_per_s']:.0f} training tokens/s over {steps} steps "
              f"({runs[mode]['wall_s']:.0f} s, data share {100 * runs[mode]['data_share']:.1f}%, "
              f"peak RSS {runs[mode]['peak_rss_mib']:.0f} MiB), load {uptime()}", flush=True)
    a, b = runs["padded"], runs["packed"]
    diff = max(abs(x - y) / max(abs(x), 1e-9) for x, y in zip(a["losses"], b["losses"]))
    print(f"packed / padded tokens/s = {b['tokens_per_s'] / a['tokens_per_s']:.2f}; largest relative loss difference "
          f"over the {steps} steps {diff:.2e} (first loss {a['losses'][0]:.4f} vs {b['losses'][0]:.4f}, "
          f"last {a['losses'][-1]:.4f} vs {b['losses'][-1]:.4f})")


def reference_status(python: str) -> str | None:
    """Why the reference trainer (speculators 0.9.0) cannot run beside the rows, or None."""
    from reference_row import status

    return status(python)


def result_rows(root: Path, names: list[str]) -> list[dict]:
    """Result files of the named rows (all when none), in ``VARIANTS`` order: each row, its
    screening runs and its run through the asset; then the reference trainer's."""
    found = {p.stem: json.loads(p.read_text()) for p in sorted((root / "results").glob("*.json"))
             if not p.stem.startswith(("greedy-", "replay-"))}
    rows = []
    for name in names or list(VARIANTS):
        rows += [r for stem, r in found.items()
                 if stem == name or stem == f"{name}_asset" or re.fullmatch(rf"{re.escape(name)}_s[0-9.]+", stem)]
    if not names or "reference" in names:  # speculators 0.9.0 on the same data (reference_row.py)
        from reference_row import table_rows

        rows += table_rows(root)
    return rows


def table(root: Path, names: list[str]) -> str:
    """The ablation table (markdown) from the rows' result files, in ``VARIANTS`` order."""
    head = ("| row | what changes | AL project | AL vLLM | per position (project) | per position (vLLM) | "
            "untrained AL | train tok/s | train s | row s | trainer peak RSS MiB | load (1/5/15 min) |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in result_rows(root, names):
        t, u, v, tr = r["eval"]["trained"], r["eval"].get("untrained") or {}, r["vllm"], r["train"]
        vl = f"{v['acceptance_length']:.3f}" if "acceptance_length" in v else v.get("skipped", "-")
        vp = " / ".join(f"{x:.2f}" for x in v.get("per_position_rate", [])) or "-"
        ul = f"{u['acceptance_length']:.3f}" if u else "-"
        out.append(f"| {r['name']} | {r['description']} | {t['acceptance_length']:.3f} | {vl} | "
                   f"{' / '.join(f'{x:.2f}' for x in t['per_position_rate'])} | {vp} | {ul} | "
                   f"{tr['tokens_per_s']:.0f} | {tr['wall_s']:.0f} | {r['row_wall_s']:.0f} | "
                   f"{r['trainer_peak_rss_mib']:.0f} | {r['load_before']} |")
    return "\n".join(out)


def plot_curves(root: Path, names: list[str], path: Path) -> Path | None:
    """Acceptance length over training (the replay evaluator on each row's kept checkpoints), one
    line per row, with the 2.2 goal and the reference trainer's figure when there is one."""
    rows = [r for r in result_rows(root, names) if r.get("curve")]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    palette = plt.get_cmap("tab20").colors
    for i, r in enumerate(rows):
        xs = [c["epoch"] / r["recipe"]["epochs"] for c in r["curve"]]
        # today's recipe in black, combinations bold, single levers thin: the eye finds the
        # baseline and the winners first among a dozen lines.
        if r["name"] == "today":
            style = dict(color="black", linewidth=2.2)
        elif r["name"].startswith("replies8") or r["name"] in ("levers", "noise_norm_fc"):
            style = dict(color=palette[i % len(palette)], linewidth=2.0)
        else:
            style = dict(color=palette[i % len(palette)], linewidth=1.0, alpha=0.8)
        ax.plot(xs, [c["acceptance_length"] for c in r["curve"]], marker="o", markersize=3,
                label=r["name"], **style)
    ref = [r for r in result_rows(root, ["reference"]) if r["name"].startswith("reference")]
    for r in ref:
        ax.axhline(r["eval"]["trained"]["acceptance_length"], color="gray", linestyle=":", label=r["name"])
    ax.axhline(2.2, color="black", linestyle="--", linewidth=1, label="goal 2.2")
    ax.set_xlabel("share of the row's training run")
    ax.set_ylabel("acceptance length (k=3, held-out)")
    ax.set_title("Acceptance over training, replay evaluator")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path


def run_reference(args) -> None:
    """speculators 0.9.0 beside the rows (``reference_row.py``), or one line saying why not."""
    from reference_row import run

    run(args.root.resolve(), args.reference_python, threads=args.threads, vllm=not args.no_vllm, force=args.force,
        epochs=args.reference_epochs, limit=args.reference_limit)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["data", "speed", "row", "table", "reference", "final", "_train", "_fit", "_speed"])
    ap.add_argument("names", nargs="*", help="data variants (data) or rows (row, table); default: all")
    ap.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    ap.add_argument("--backend", choices=["vllm", "local"], default="vllm", help="data: who writes the replies")
    ap.add_argument("--max-samples", type=int, default=0, help="data: new replies per dataset in this run (0: all)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the trainer")
    ap.add_argument("--no-vllm", action="store_true", help="rows: skip the vLLM server measurement")
    ap.add_argument("--force", action="store_true", help="rows: rerun rows that have results")
    ap.add_argument("--scale", type=float, default=1.0, help="rows: screening runs at this share of the epochs")
    ap.add_argument("--steps", type=int, default=30, help="speed: optimizer steps per run")
    ap.add_argument("--piece-steps", type=int, default=0,
                    help="screening rows: train in resumable pieces of this many steps (0: one piece)")
    ap.add_argument("--reference", action="store_true", help="rows: also train speculators 0.9.0 on the same data "
                    "(once; cached as results/reference_speculators.json)")
    ap.add_argument("--reference-python", default=str(REPO / ".venv-speculators" / "bin" / "python"))
    ap.add_argument("--reference-epochs", type=int, default=None, help="reference: a smoke run of this many epochs")
    ap.add_argument("--reference-limit", type=int, default=None, help="reference: a smoke run on the first N train rows")
    args = ap.parse_args(argv)
    setup_env(args.root.resolve())
    if args.command == "data":
        make_data(args.root, args.prompts, args.names or list(DATA), backend=args.backend, max_samples=args.max_samples)
    elif args.command == "_train":
        print(json.dumps(train_row(args.names[0], args.threads)))
    elif args.command == "_fit":
        print(json.dumps(fit_row(args.root, args.names[0], args.threads, args.piece_steps)))
    elif args.command == "_speed":
        print(json.dumps(speed_once(args.root, args.names[0], args.steps, args.threads)))
    elif args.command == "speed":
        speed(args.root, args.steps, args.threads)
    elif args.command == "row":
        for name in args.names or list(VARIANTS):
            run_row(args.root, name, threads=args.threads, vllm=not args.no_vllm, force=args.force, scale=args.scale,
                    piece_steps=args.piece_steps)
        if args.reference:
            run_reference(args)
    elif args.command == "final":
        for name in args.names:
            run_final(args.root, name, threads=args.threads)
    elif args.command == "reference":
        run_reference(args)
    elif args.command == "table":
        print(table(args.root, args.names))
        png = plot_curves(args.root, args.names, args.root / "results" / "acceptance_over_training.png")
        if png:
            print(f"acceptance over training: {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
