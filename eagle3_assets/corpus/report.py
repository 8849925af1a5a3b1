"""Every dataset's inventory as one terminal table (``eagle3 inventory`` and the demo)."""

from __future__ import annotations

from eagle3_assets.corpus.inventory import read_inventory
from eagle3_assets.paths import DataLayout

INVENTORY_COLUMNS = [
    ("dataset", "dataset"), ("source", "source"), ("responses", "responses"),
    ("completion_tokens", "tokens"), ("mean_len", "mean"), ("p50_len", "p50"), ("p95_len", "p95"),
    ("finish_reasons", "finish reasons"), ("budget_used", "budget used"),
    ("budget_remaining", "remaining"), ("cost_usd", "kept $"), ("billed_usd", "billed $"),
    ("billed_dead_runs_usd", "of it, runs that died $"), ("missing", "missing"),
]


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 10 else f"{v:,.4g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def print_inventory(layout: DataLayout) -> None:
    """Every dataset's inventory in one table."""
    from rich.console import Console
    from rich.table import Table

    frame = read_inventory(layout.metadata_db)
    console = Console(width=160)
    if frame.is_empty():
        console.print(f"No inventory yet in {layout.metadata_db}: materialize the `inventory` asset first.")
        return
    table = Table(title=f"Inventory ({layout.metadata_db})")
    for _, title in INVENTORY_COLUMNS:
        table.add_column(title, justify="left" if title in ("dataset", "source", "finish reasons") else "right")
    for row in frame.iter_rows(named=True):
        table.add_row(*[_fmt(row.get(k)) for k, _ in INVENTORY_COLUMNS],
                      style="bold" if row["source"] == "all" else None)
    console.print(table)
    if "updated_at" in frame.columns:
        stamps = frame.filter(frame["source"] == "all").select("dataset", "updated_at").rows()
        console.print("'remaining' is the budget inventory recorded when it last ran, minus what was used then ("
                      + ", ".join(f"{d}: {t:%Y-%m-%d %H:%M}" if t else f"{d}: ?" for d, t in stamps) + "); a budget "
                      "changed since is judged by the token_budget check, which reads the configured one.")
    if "billed_dead_runs_usd" in frame.columns and (frame["billed_dead_runs_usd"].fill_null(0.0) > 0).any():
        from eagle3_assets.generation.key_ledger import CAVEAT

        console.print("'of it, runs that died': what runs that were killed or crashed were billed beyond what their "
                      f"replies showed (requests in flight when they died), reconciled by the next run {CAVEAT}.")
