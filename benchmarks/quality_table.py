"""The drafter-quality benchmark's results read back: each row's result file, the ablation table
(markdown), the figures ``table`` records for the docs, how well the trainer's acceptance estimate
ranks drafters against the evaluators (Spearman), and the acceptance-over-training plot."""

from __future__ import annotations

import json
import re
from pathlib import Path

import reference_row
from quality_recipes import VARIANTS, exported_estimate


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
        rows += reference_row.table_rows(root)
    return rows


def table(root: Path, names: list[str]) -> str:
    """The ablation table (markdown) from the rows' result files, in ``VARIANTS`` order."""
    head = ("| row | what changes | AL project | AL vLLM | AL SGLang | EAL (step) | per position (project) | "
            "per position (vLLM) | per position (SGLang) | untrained AL | train tok/s | train s | row s | "
            "trainer peak RSS MiB | load (1/5/15 min) |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in result_rows(root, names):
        t, u, v, tr = r["eval"]["trained"], r["eval"].get("untrained") or {}, r["vllm"], r["train"]
        vl = f"{v['acceptance_length']:.3f}" if "acceptance_length" in v else v.get("skipped", "-")
        vp = " / ".join(f"{x:.2f}" for x in v.get("per_position_rate", [])) or "-"
        g = r.get("sglang") or {}
        sl = f"{g['acceptance_length']:.3f}" if "acceptance_length" in g else g.get("skipped", "-")
        sp = " / ".join(f"{x:.2f}" for x in g.get("per_position_rate", [])) or "-"
        ul = f"{u['acceptance_length']:.3f}" if u else "-"
        e = exported_estimate(tr)
        el = f"{e['eal']:.3f} ({e['step']})" if e else "-"
        out.append(f"| {r['name']} | {r['description']} | {t['acceptance_length']:.3f} | {vl} | {sl} | {el} | "
                   f"{' / '.join(f'{x:.2f}' for x in t['per_position_rate'])} | {vp} | {sp} | {ul} | "
                   f"{tr['tokens_per_s']:.0f} | {tr['wall_s']:.0f} | {r['row_wall_s']:.0f} | "
                   f"{r['trainer_peak_rss_mib']:.0f} | {r['load_before']} |")
    rows = result_rows(root, names)
    return "\n".join([*out, "", rank_lines(rank_correlations(rows)), "", spread_lines(seed_spread(rows))])


def seed_spread(rows: list[dict]) -> dict:
    """Each recipe run on several seeds (``<row>`` is seed 0, ``<row>_seed<n>`` the others): the
    seeds' mean, lowest and highest acceptance length by each evaluator, so a lever's gain can be
    read against the spread of one recipe."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(re.sub(r"_seed[0-9]+$", "", r["name"]), []).append(r)
    out = {}
    for base, rs in groups.items():
        if len(rs) < 2:
            continue
        out[base] = {"seeds": len(rs), "rows": [r["name"] for r in rs]}
        for label, al in EVALUATORS.items():
            vals = [v for r in rs if (v := al(r)) is not None]
            if vals:
                out[base][f"AL {label}"] = {"mean": sum(vals) / len(vals), "min": min(vals), "max": max(vals),
                                            "n": len(vals)}
    return out


def spread_lines(spread: dict) -> str:
    if not spread:
        return "No recipe has more than one seed among these rows."
    lines = ["Across seeds (mean, lowest to highest, seeds):"]
    for base, s in spread.items():
        figs = ", ".join(f"{k} {v['mean']:.3f} ({v['min']:.3f} to {v['max']:.3f}, {v['n']})"
                         for k, v in s.items() if k.startswith("AL "))
        lines.append(f"- {base}: {figs}")
    return "\n".join(lines)


EVALUATORS = {"project": lambda r: r["eval"]["trained"].get("acceptance_length"),
              "vLLM": lambda r: (r.get("vllm") or {}).get("acceptance_length"),
              "SGLang": lambda r: (r.get("sglang") or {}).get("acceptance_length")}


def rank_correlations(rows: list[dict]) -> dict:
    """Spearman's rank correlation of the trainer's acceptance estimate with acceptance length: across
    rows, each row's exported drafter's EAL against each evaluator's AL on it; within each row whose
    checkpoints were scored, every checkpoint's EAL against the replay evaluator's AL there."""
    from eagle3_assets.drafter.training.acceptance import spearman

    out = {}
    for label, al in EVALUATORS.items():
        pairs = [(e["eal"], al(r)) for r in rows if (e := exported_estimate(r["train"])) and al(r) is not None]
        out[f"rows: AL {label}"] = {"spearman": spearman(*zip(*pairs)) if pairs else None, "pairs": len(pairs)}
    for r in rows:
        points = [(c["eal"], c["acceptance_length"]) for c in r.get("curve") or [] if c.get("eal") is not None]
        if points:
            out[f"checkpoints: {r['name']}"] = {"spearman": spearman(*zip(*points)), "pairs": len(points)}
    return out


def rank_lines(corr: dict) -> str:
    def fig(v):
        return "-" if v["spearman"] is None else f"{v['spearman']:+.2f}"

    rows = [f"{k.split(': ')[1]} {fig(v)} ({v['pairs']})" for k, v in corr.items() if k.startswith("rows")]
    within = [f"{k.split(': ')[1]} {fig(v)} ({v['pairs']})" for k, v in corr.items() if k.startswith("checkpoints")]
    return ("Rank correlation (Spearman, pairs) of the trainer's acceptance estimate (EAL) with acceptance length:\n"
            f"- across rows, the exported drafters: {', '.join(rows)}\n"
            f"- across each row's checkpoints, against the replay evaluator: {', '.join(within) or 'no scored checkpoints'}")


def table_figures(r: dict) -> dict:
    """One ablation row's figures as the table prints them (the docs' table is checked against these)."""
    t, u, v, tr = r["eval"]["trained"], r["eval"].get("untrained") or {}, r["vllm"], r["train"]
    g = r.get("sglang") or {}
    return {"AL project": t["acceptance_length"], "AL vLLM": v.get("acceptance_length"),
            "AL SGLang": g.get("acceptance_length"),
            # each evaluator's own count of verification steps and accepted draft tokens
            "steps project": t.get("verify_steps"), "steps vLLM": v.get("drafts"), "steps SGLang": g.get("drafts"),
            "accepted project": (sum(i * n for i, n in enumerate(t["accepted_histogram"]))
                                 if "accepted_histogram" in t else None),
            "accepted vLLM": v.get("accepted_tokens"), "accepted SGLang": g.get("accepted_tokens"),
            "SGLang s": g.get("seconds"), "vLLM s": v.get("seconds"),  # server start + decoding
            "untrained AL": u.get("acceptance_length"),
            "EAL": (exported_estimate(tr) or {}).get("eal"), "EAL step": tr.get("exported_step"),
            "EAL last": tr.get("eal_last"), "train tok/s": tr["tokens_per_s"], "train s": tr["wall_s"],
            "row s": r["row_wall_s"], "trainer peak RSS MiB": r["trainer_peak_rss_mib"], "load (1/5/15 min)": r["load_before"],
            "finished_at": r.get("finished_at")}


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
