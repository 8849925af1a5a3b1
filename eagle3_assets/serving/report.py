"""What the asset's metadata shows: the sweep's table in Markdown and two plots the UI renders
(speedup against concurrency per engine, acceptance per category)."""

from __future__ import annotations

from eagle3_assets.metadata import md_table
from eagle3_assets.serving.results import ALL

COLUMNS = ("engine", "setting", "concurrency", "category", "acceptance_length", "tokens_per_s", "tpot_ms", "ttft_ms",
           "speedup", "outputs_equal_baseline")


def table_markdown(table: list[dict], *, pooled_only: bool = False):
    shown = [r for r in table if r["category"] == ALL] if pooled_only else table
    return md_table([{k: ("" if r[k] is None else r[k]) for k in COLUMNS} for r in shown])


def provenance_markdown(table: list[dict]):
    """One line per engine x setting: where its figures come from."""
    seen = {}
    for r in table:
        p = r["provenance"]
        seen.setdefault((r["engine"], r["setting"]), {
            "engine": r["engine"], "setting": r["setting"], "version": p["engine_version"],
            "export_sha256": (p.get("export_sha256") or "")[:16], "bench_hash": p["bench_hash"][:16],
            "machine": p["machine"], "serve_command": f"`{p['serve_command']}`"})
    return md_table(list(seen.values()))


def speedup_plot(table: list[dict]) -> str:
    """Best pooled speedup per engine at each concurrency level (one line per setting)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eagle3_assets.plots import png_markdown

    fig, ax = plt.subplots(figsize=(6, 3))
    lines: dict[tuple, list] = {}
    for r in table:
        if r["category"] == ALL and r["steps"] > 0 and r["speedup"] is not None:
            lines.setdefault((r["engine"], r["setting"]), []).append((r["concurrency"], r["speedup"]))
    for (engine, setting), pts in sorted(lines.items()):
        pts.sort()
        ax.plot([c for c, _ in pts], [s for _, s in pts], marker="o", label=f"{engine} {setting}")
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
    ax.set_xlabel("concurrency")
    ax.set_ylabel("speedup (output tokens/s)")
    ax.set_title("speedup against the baseline of the same run")
    if lines:
        ax.legend(fontsize=7)
    try:
        return png_markdown(fig, "speedup against concurrency")
    finally:
        plt.close(fig)


def acceptance_plot(table: list[dict]) -> str:
    """Acceptance length per category, one bar group per engine x setting at the lowest concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eagle3_assets.plots import png_markdown

    rows = [r for r in table if r["steps"] > 0 and r["category"] != ALL and r["acceptance_length"] is not None]
    low = min((r["concurrency"] for r in rows), default=1)
    rows = [r for r in rows if r["concurrency"] == low]
    cats = list(dict.fromkeys(r["category"] for r in rows))
    series = list(dict.fromkeys((r["engine"], r["setting"]) for r in rows))
    fig, ax = plt.subplots(figsize=(7, 3))
    width = 0.8 / max(1, len(series))
    for i, s in enumerate(series):
        vals = {r["category"]: r["acceptance_length"] for r in rows if (r["engine"], r["setting"]) == s}
        ax.bar([j + i * width for j in range(len(cats))], [vals.get(c, 0.0) for c in cats], width,
               label=f"{s[0]} {s[1]}")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))], cats, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("acceptance length")
    ax.set_title(f"acceptance per category (engine counters, concurrency {low})")
    if series:
        ax.legend(fontsize=7)
    try:
        return png_markdown(fig, "acceptance per category")
    finally:
        plt.close(fig)
