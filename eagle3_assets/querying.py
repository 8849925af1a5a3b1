"""DuckDB helpers shared by the asset checks."""

from __future__ import annotations

SAMPLE = 10  # offending rows shown in a check's metadata


def query_rows(con, sql: str, params: list) -> list[dict]:
    """Rows of a query as dicts keyed by column name."""
    cur = con.execute(sql, params)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r)) for r in cur.fetchall()]


def name_rows(rows: list[dict], total: int | None = None, n: int = 5) -> str:
    """The first ``n`` rows as ``dataset/sample_id`` (or the sample id alone), and how many more: a
    description names the rows, not only their count."""
    shown = [f"{r['dataset']}/{r['sample_id']}" if r.get("dataset") else str(r.get("sample_id", r.get("prompt_id")))
             for r in rows[:n]]
    more = (len(rows) if total is None else total) - len(shown)
    return ", ".join(shown) + (f" and {more:,} more" if more > 0 else "")
