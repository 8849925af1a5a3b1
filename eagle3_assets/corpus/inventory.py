"""Per-dataset inventory: responses, lengths, finish reasons, budget and cost, by source.

Figures are computed by DuckDB over the response rows and stored in ``metadata.duckdb``,
one row per (dataset, source) plus an ``all`` row, beside the ``unanswered`` table (one row per
prompt still without a response, with its reason). Only the inventory asset writes there.

Dollars: ``cost_usd`` is what the kept rows cost; ``billed_usd`` adds every billed attempt that left
no row (``billing.jsonl``: failed or retried replies, and the provider's bill beyond what replies
showed); ``billed_dead_runs_usd`` is the part of it runs that died were billed beyond what they
saw, reconciled from the key's usage by the run after them. ``missing`` (on the ``all`` row)
counts prompts without any response.
"""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import polars as pl

from eagle3_assets.generation.key_ledger import DEAD_RUN_REASON

SCHEMA = """
CREATE TABLE IF NOT EXISTS inventory (
    dataset VARCHAR, source VARCHAR, responses BIGINT, completion_tokens BIGINT,
    prompt_tokens BIGINT, mean_len DOUBLE, p50_len DOUBLE, p95_len DOUBLE,
    finish_reasons VARCHAR, truncated BIGINT, budget_tokens BIGINT, budget_used BIGINT,
    budget_remaining BIGINT, cost_usd DOUBLE, updated_at TIMESTAMP,
    PRIMARY KEY (dataset, source)
)
"""
# Columns added later; ALTER keeps databases written by earlier versions usable.
ADDED_COLUMNS = {"billed_usd": "DOUBLE", "missing": "BIGINT", "billed_dead_runs_usd": "DOUBLE",
                 "tool_call_responses": "BIGINT", "tools_unused": "BIGINT", "tool_call_native_rows": "BIGINT",
                 "tool_call_agreement": "DOUBLE", "tool_call_exact_rate": "DOUBLE"}
UNANSWERED_SCHEMA = """
CREATE TABLE IF NOT EXISTS unanswered (dataset VARCHAR, prompt_id VARCHAR, reason VARCHAR, detail VARCHAR)
"""
COLUMNS = ["dataset", "source", "responses", "completion_tokens", "prompt_tokens", "mean_len", "p50_len",
           "p95_len", "finish_reasons", "truncated", "budget_tokens", "budget_used", "budget_remaining", "cost_usd",
           "billed_usd", "billed_dead_runs_usd", "missing", "tool_call_responses", "tools_unused", "tool_call_native_rows",
           "tool_call_agreement", "tool_call_exact_rate"]
# the tool-call figures of token_ids, per source: replies rebuilt by the chat template, measured on native rows
TOOL_CALL_FIGURES = ["tool_call_native_rows", "tool_call_agreement", "tool_call_exact_rate"]

RESPONSE_COLUMNS = {
    "sample_id": pl.Utf8, "source": pl.Utf8, "finish_reason": pl.Utf8,
    "completion_tokens": pl.Int64, "prompt_tokens": pl.Int64, "cost_usd": pl.Float64,
    "tool_calls": pl.Int64, "tools_unused": pl.Boolean,  # calls in the reply; a prompt with tools answered without one
}

SUMMARY_SQL = """
SELECT coalesce(source, 'all') AS source,
       count(*) AS responses,
       coalesce(sum(completion_tokens), 0)::BIGINT AS completion_tokens,
       coalesce(sum(prompt_tokens), 0)::BIGINT AS prompt_tokens,
       avg(completion_tokens) AS mean_len,
       quantile_cont(completion_tokens, 0.5) AS p50_len,
       quantile_cont(completion_tokens, 0.95) AS p95_len,
       count(*) FILTER (WHERE finish_reason = 'length') AS truncated,
       coalesce(sum(cost_usd), 0) AS cost_usd,
       count(*) FILTER (WHERE tool_calls > 0) AS tool_call_responses,
       count(*) FILTER (WHERE tools_unused) AS tools_unused
FROM responses GROUP BY ROLLUP (source) ORDER BY source = 'all', source
"""


def response_frame(rows: list[dict]) -> pl.DataFrame:
    derived = {"tool_calls": lambda r: len(r.get("tool_calls") or ()),
               "tools_unused": lambda r: "tools_unused" in (r.get("flags") or ())}
    data = {k: [derived[k](r) if k in derived else r.get(k) for r in rows] for k in RESPONSE_COLUMNS}
    return pl.DataFrame(data, schema=RESPONSE_COLUMNS)


def tool_call_figures(tokens: pl.DataFrame | None) -> dict[str, dict]:
    """Per source (and ``all``): token agreement and exact rate of the tool-call replies with native
    ids, rebuilt by the chat template from their parsed calls (the token table's figures)."""
    if tokens is None or "tool_calls" not in tokens.columns:
        return {}
    native = tokens.filter(pl.col("native_ids") & (pl.col("tool_calls") > 0))
    out = {}
    for source, part in [("all", native), *native.group_by("source")]:
        name = source[0] if isinstance(source, tuple) else source
        total = int(part["retok_total"].sum() or 0)
        out[name] = {"tool_call_native_rows": part.height,
                     "tool_call_agreement": int(part["retok_matched"].sum() or 0) / total if total else None,
                     "tool_call_exact_rate": float(part["retok_exact"].mean()) if part.height else None}
    return out


def summarize(dataset: str, responses: pl.DataFrame, budget_tokens: int, billing: list[dict] | None = None,
              missing: int | None = None, tool_calls: dict[str, dict] | None = None) -> pl.DataFrame:
    """Inventory rows for one dataset: each source, then ``all``. ``billing`` holds the billed
    attempts that left no row; ``missing`` the prompts without a response; ``tool_calls`` the
    reconstruction figures of :func:`tool_call_figures`."""
    con = duckdb.connect()
    con.register("responses", responses.to_arrow())
    summary = con.execute(SUMMARY_SQL).pl()
    reasons = con.execute(
        "SELECT coalesce(source, 'all') AS source, finish_reason, count(*) AS n FROM responses "
        "GROUP BY GROUPING SETS ((source, finish_reason), (finish_reason))"
    ).fetchall()
    con.close()
    if responses.height == 0:
        summary = pl.DataFrame({"source": ["all"]}).join(summary, on="source", how="left")
        summary = summary.with_columns(pl.col("responses", "completion_tokens", "prompt_tokens", "truncated").fill_null(0),
                                       pl.col("cost_usd").fill_null(0.0))
    by_source: dict[str, dict] = {}
    for source, reason, n in reasons:
        by_source.setdefault(source, {})[str(reason)] = n
    used = int(responses["completion_tokens"].sum() or 0)
    extra: dict[str, float] = {}  # billed without a row, by source and in all
    dead: dict[str, float] = {}  # of it, what runs that died were billed
    for b in billing or []:
        cost = b.get("cost_usd") or 0.0
        for src in {b.get("source") or "all", "all"}:
            extra[src] = extra.get(src, 0.0) + cost
            if b.get("reason") == DEAD_RUN_REASON:
                dead[src] = dead.get(src, 0.0) + cost
    for src in extra:
        if src not in summary["source"].to_list():  # billed for a source that kept no row
            summary = pl.concat([summary, pl.DataFrame({"source": [src]})], how="diagonal_relaxed")
    summary = summary.with_columns(pl.col("responses", "completion_tokens", "prompt_tokens", "truncated",
                                          "tool_call_responses", "tools_unused").fill_null(0),
                                   pl.col("cost_usd").fill_null(0.0))
    figures = tool_calls or {}
    summary = summary.with_columns(
        pl.col("source").map_elements(lambda s: (figures.get(s) or {}).get("tool_call_native_rows", 0),
                                      return_dtype=pl.Int64).alias("tool_call_native_rows"),
        *[pl.col("source").map_elements(lambda s, k=k: (figures.get(s) or {}).get(k), return_dtype=pl.Float64)
          .alias(k) for k in ("tool_call_agreement", "tool_call_exact_rate")])
    return summary.with_columns(
        pl.lit(dataset).alias("dataset"),
        pl.col("source").map_elements(lambda s: json.dumps(by_source.get(s, {}), sort_keys=True),
                                      return_dtype=pl.Utf8).alias("finish_reasons"),
        pl.lit(budget_tokens, pl.Int64).alias("budget_tokens"),
        pl.lit(used, pl.Int64).alias("budget_used"),
        pl.lit(budget_tokens - used, pl.Int64).alias("budget_remaining"),
        (pl.col("cost_usd") + pl.col("source").replace_strict(extra, default=0.0, return_dtype=pl.Float64))
        .alias("billed_usd"),
        pl.col("source").replace_strict(dead, default=0.0, return_dtype=pl.Float64).alias("billed_dead_runs_usd"),
        pl.when(pl.col("source") == "all").then(pl.lit(missing, pl.Int64)).otherwise(None).alias("missing"),
    ).select(COLUMNS).sort(pl.col("source") == "all", "source")


def write_inventory(db_path: Path, dataset: str, rows: pl.DataFrame, unanswered: list[dict] | None = None) -> None:
    """Replace the dataset's rows (and its unanswered prompts) in one transaction; the connection is held briefly."""
    db_path.parent.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect(str(db_path))
    try:
        con.execute(SCHEMA)
        for name, kind in ADDED_COLUMNS.items():
            con.execute(f"ALTER TABLE inventory ADD COLUMN IF NOT EXISTS {name} {kind}")
        con.execute(UNANSWERED_SCHEMA)
        con.execute("BEGIN")
        con.execute("DELETE FROM inventory WHERE dataset = ?", [dataset])
        con.register("new_rows", rows.to_arrow())
        cols = ", ".join(COLUMNS)
        con.execute(f"INSERT INTO inventory ({cols}, updated_at) SELECT {cols}, now() FROM new_rows")
        con.execute("DELETE FROM unanswered WHERE dataset = ?", [dataset])
        if unanswered:
            frame = pl.DataFrame([{"dataset": dataset, **u} for u in unanswered],
                                 schema={"dataset": pl.Utf8, "prompt_id": pl.Utf8, "reason": pl.Utf8, "detail": pl.Utf8})
            con.register("new_unanswered", frame.to_arrow())
            con.execute("INSERT INTO unanswered SELECT dataset, prompt_id, reason, detail FROM new_unanswered")
        con.execute("COMMIT")
    finally:
        con.close()


def read_inventory(db_path: Path, dataset: str | None = None) -> pl.DataFrame:
    """Inventory rows, opened read-only so readers never block the single writer."""
    if not Path(db_path).exists():
        return pl.DataFrame()
    con = duckdb.connect(str(db_path), read_only=True)
    try:
        sql = "SELECT * FROM inventory"
        params: list = []
        if dataset is not None:
            sql += " WHERE dataset = ?"
            params.append(dataset)
        return con.execute(sql + " ORDER BY dataset, source = 'all', source", params).pl()
    finally:
        con.close()
