"""Helpers that turn figures into readable Dagster metadata (Markdown tables, previews)."""

from __future__ import annotations

import dagster as dg


def _cell(v) -> str:
    if isinstance(v, float):
        v = f"{v:,.4g}" if abs(v) < 1e6 else f"{v:,.0f}"
    elif isinstance(v, int) and not isinstance(v, bool):
        v = f"{v:,}"
    s = "" if v is None else str(v)
    s = s.replace("\n", "⏎").replace("|", "\\|")
    return s if len(s) <= 120 else s[:117] + "..."


def md_table(rows: list[dict], columns: list[str] | None = None) -> dg.MetadataValue:
    """A Markdown table; the UI renders it, and it survives any column type."""
    if not rows:
        return dg.MetadataValue.md("_(none)_")
    columns = columns or list(rows[0].keys())
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
    return dg.MetadataValue.md("\n".join(lines))
