"""The drafter-quality benchmark's rows as recipes: the data variants, today's recipe (BASE) and
each row's changes to it (VARIANTS), the recipe files written from them, and the environment and
load figures every row records. Shared by ``drafter_quality.py`` (the rows) and
``reference_row.py`` (speculators beside them); imports nothing of the project until called, so
``setup_env`` can point the project at the benchmark's data root first."""

from __future__ import annotations

import json
import math
import os
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
    "fc_norm": ("+ EAGLE 3.1 fc_norm: an RMSNorm per aux layer before fc", {"fc_norm": True}),
    "norm_output": ("+ EAGLE 3.1 norm_output: the post-norm state fed to the next step", {"norm_output": True}),
    "eagle31": ("+ EAGLE 3.1: fc_norm and norm_output", {"fc_norm": True, "norm_output": True}),
    "today_seed1": ("today's recipe with seed 1 (initialisation, batch order)", {"seed": 1}),
    "today_seed2": ("today's recipe with seed 2", {"seed": 2}),
    "eagle31_seed1": ("eagle31 with seed 1", {"fc_norm": True, "norm_output": True, "seed": 1}),
    "eagle31_seed2": ("eagle31 with seed 2", {"fc_norm": True, "norm_output": True, "seed": 2}),
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
    "replies8_noise_e3_seed1": ("replies8_noise_e3 with seed 1 (initialisation, batch order, noise draws)",
                                {"datasets": GREEDY_AND_8, "feature_noise": 0.1, "epochs": 3, "seed": 1}),
    "replies8_noise_e3_seed2": ("replies8_noise_e3 with seed 2",
                                {"datasets": GREEDY_AND_8, "feature_noise": 0.1, "epochs": 3, "seed": 2}),
    "replies8_noise_eagle31_e3": ("replies8_noise_e3 as EAGLE 3.1 (fc_norm and norm_output)",
                                  {"datasets": GREEDY_AND_8, "feature_noise": 0.1, "epochs": 3, "fc_norm": True,
                                   "norm_output": True}),
    "replies8_noise_eagle31_e3_seed1": ("replies8_noise_eagle31_e3 with seed 1 (initialisation, batch order, noise draws)",
                                        {"datasets": GREEDY_AND_8, "feature_noise": 0.1, "epochs": 3, "fc_norm": True,
                                         "norm_output": True, "seed": 1}),
    "replies8_noise_eagle31_e3_seed2": ("replies8_noise_eagle31_e3 with seed 2",
                                        {"datasets": GREEDY_AND_8, "feature_noise": 0.1, "epochs": 3, "fc_norm": True,
                                         "norm_output": True, "seed": 2}),
    "replies8_noise_norm_fc_e3_seed2": ("replies8_noise_norm_fc_e3 with seed 2",
                                        {"datasets": GREEDY_AND_8, "feature_noise": 0.1, "norm_before_fc": True,
                                         "engines": ["vllm"], "epochs": 3, "seed": 2}),
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


CURVE_POINTS = 10  # checkpoints per row scored by the replay evaluator (acceptance over training)


def curve_schedule(table: dict) -> dict:
    """``checkpoint_every`` and ``keep_checkpoints`` for about ``CURVE_POINTS`` scored checkpoints
    over the row's run (neither changes the trained weights)."""
    from eagle3_assets.paths import DataLayout

    layout = DataLayout.from_env()
    samples = sum(w * corpus_figures(layout, d)["train"]["samples"] for d, w in table["datasets"].items())
    total = math.ceil(table["epochs"] * math.ceil(samples / table["batch_size"]))
    return {"checkpoint_every": max(1, total // CURVE_POINTS), "keep_checkpoints": CURVE_POINTS + 2}


def exported_estimate(trained: dict) -> dict | None:
    """The trainer's acceptance estimate of the checkpoint it exported (the best by it), from its
    result.json; None for a row trained before the estimate existed, or by the reference trainer."""
    return next((e for e in trained.get("acceptance_estimates") or [] if e["step"] == trained.get("exported_step")), None)


def line(row: dict) -> str:
    t, v, tr = row["eval"]["trained"], row["vllm"], row["train"]
    vl = f"{v['acceptance_length']:.3f}" if "acceptance_length" in v else "-"
    g = row.get("sglang") or {}
    sl = f"{g['acceptance_length']:.3f}" if "acceptance_length" in g else "-"
    e = exported_estimate(tr)
    el = f"EAL {e['eal']:.3f} at step {e['step']}" if e else "no EAL"
    return (f"AL {t['acceptance_length']:.3f} (vLLM {vl}, SGLang {sl}; {el}), per position "
            f"{' '.join(f'{x:.2f}' for x in t['per_position_rate'])}, {tr['tokens_per_s']:.0f} tok/s, "
            f"train {tr['wall_s']:.0f}s, row {row['row_wall_s']:.0f}s, trainer peak RSS {row['trainer_peak_rss_mib']:.0f} MiB"
            + ("; over training (epoch: AL / EAL) " + ", ".join(
                f"{c['epoch']:g}: {c['acceptance_length']:.3f}" + (f" / {c['eal']:.3f}" if c.get("eal") is not None else "")
                for c in row["curve"])
               if row.get("curve") else ""))
