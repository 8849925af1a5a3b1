"""DuckDB helpers shared by the asset checks."""

from __future__ import annotations

SAMPLE = 10  # offending rows shown in a check's metadata


def query_rows(con, sql: str, params: list) -> list[dict]:
    """Rows of a query as dicts keyed by column name."""
    cur = con.execute(sql, params)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r)) for r in cur.fetchall()]
