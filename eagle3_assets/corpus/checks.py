"""Checks on ``inventory`` and ``merged_corpus``: budget, truncation and corpus integrity.

DuckDB over the corpus Parquet file and (read-only) ``metadata.duckdb``; the budget and
integrity checks block, the truncation rate warns.
"""

import dagster as dg

from eagle3_assets.corpus.assets import inventory, merged_corpus
from eagle3_assets.generation.admission import EXPECTED_OVERSHOOT_ALLOWANCE
from eagle3_assets.generation.response_store import ResponseStore
from eagle3_assets.metadata import md_table
from eagle3_assets.partitions import datasets_partitions
from eagle3_assets.querying import SAMPLE, name_rows, query_rows
from eagle3_assets.resources import DatasetSettings, StorageResource
from eagle3_assets.tokens.digest import DIGEST_COLUMN, verify_table_digest, verify_token_table


@dg.asset_check(asset=inventory, blocking=True, partitions_def=datasets_partitions, pool="duckdb",
                description="Completion tokens of the dataset are within its budget as configured now (the "
                            "dataset_settings resource, not the figure inventory recorded when it last ran), within 1% "
                            "above it when its last generation ran with the `expected` budget policy; the description "
                            "names the budget judged and where it came from.")
def token_budget(context: dg.AssetCheckExecutionContext, storage: StorageResource,
                 dataset_settings: DatasetSettings) -> dg.AssetCheckResult:
    dataset = context.partition_key
    with storage.query() as con:
        rows = query_rows(con, "SELECT source, completion_tokens, budget_tokens, budget_used, budget_remaining, "
                          "updated_at FROM meta.inventory WHERE dataset = ? ORDER BY source = 'all', source", [dataset])
    total = next((r for r in rows if r["source"] == "all"), None)
    if total is None:
        return dg.AssetCheckResult(passed=False, description="no inventory row for this dataset")
    budget = dataset_settings.budget_for(dataset)
    where = (f"dataset_settings.budget_tokens[{dataset!r}]" if dataset in dataset_settings.budget_tokens
             else "dataset_settings.default_budget_tokens")
    recorded = total["budget_tokens"]
    last_run = ResponseStore(storage.layout.responses_dir(dataset)).last_run() or {}
    policy = last_run.get("budget_policy", "strict")
    allowed = budget * (1 + (EXPECTED_OVERSHOOT_ALLOWANCE if policy == "expected" else 0.0))
    used = total["budget_used"]
    overshoot = max(0, used - budget)
    stale = (f"; inventory recorded a budget of {recorded:,} when it ran ({total['updated_at']}), the configured "
             f"{budget:,} is the one judged" if recorded != budget else "")
    return dg.AssetCheckResult(
        passed=used <= allowed,
        description=f"{used:,} of {budget:,} tokens used (budget from {where})"
                    + (f" ({overshoot / budget:.2%} over, {policy} policy)" if overshoot and budget else
                       f" (over a zero budget, {policy} policy)" if overshoot else "") + stale,
        metadata={"budget_tokens": budget, "budget_source": where, "inventory_budget_tokens": recorded,
                  "budget_used": used, "budget_remaining": budget - used, "budget_overshoot": overshoot,
                  "budget_policy": policy, "by_source": md_table(rows)},
    )


@dg.asset_check(asset=inventory, partitions_def=datasets_partitions, pool="duckdb",
                description="Share of responses cut by the length limit (a warning, not a gate).")
def truncation_rate(context: dg.AssetCheckExecutionContext, storage: StorageResource,
                    dataset_settings: DatasetSettings) -> dg.AssetCheckResult:
    with storage.query() as con:
        row = con.execute("SELECT responses, truncated FROM meta.inventory WHERE dataset = ? AND source = 'all'",
                          [context.partition_key]).fetchone()
    responses, truncated = row if row else (0, 0)
    rate = truncated / responses if responses else 0.0
    return dg.AssetCheckResult(
        passed=rate <= dataset_settings.max_truncation_rate, severity=dg.AssetCheckSeverity.WARN,
        description=f"{truncated} of {responses} responses hit the length limit ({rate:.1%})",
        metadata={"truncation_rate": rate, "truncated": truncated, "responses": responses,
                  "max_truncation_rate": dataset_settings.max_truncation_rate},
    )


@dg.asset_check(asset=merged_corpus, blocking=True, partitions_def=datasets_partitions, pool="duckdb",
                description="No duplicate samples, train/eval split disjoint by prompt, no empty assistant mask; every "
                            "row's ids and mask still match the digest token_ids wrote with them (rows named); the "
                            "file's table digest matches what merged_corpus wrote (a row deleted, duplicated or moved, "
                            "an edited prompt_len or a relabelled split fails). A corpus without its digests fails.")
def corpus_integrity(context: dg.AssetCheckExecutionContext, storage: StorageResource) -> dg.AssetCheckResult:
    with storage.query() as con:
        return corpus_integrity_result(con, str(storage.layout.corpus(context.partition_key)),
                                       writer=f"merged_corpus[{context.partition_key}]")


def corpus_integrity_result(con, path: str, writer: str = "merged_corpus") -> dg.AssetCheckResult:
    """The body of ``corpus_integrity`` (``con`` a DuckDB connection, ``path`` the corpus Parquet file,
    ``writer`` the asset partition that writes it, named in what to re-materialize)."""
    rows, train, eval_ = con.execute(
        "SELECT count(*), count(*) FILTER (WHERE split = 'train'), count(*) FILTER (WHERE split = 'eval') "
        "FROM read_parquet(?)", [path]).fetchone()
    dups = query_rows(con, "SELECT sample_id, count(*) AS copies FROM read_parquet(?) GROUP BY sample_id "
                      "HAVING count(*) > 1 LIMIT ?", [path, SAMPLE])
    n_dups = con.execute("SELECT count(*) FROM (SELECT sample_id FROM read_parquet(?) GROUP BY sample_id "
                         "HAVING count(*) > 1)", [path]).fetchone()[0]
    leaks = query_rows(con, "SELECT prompt_id, list(DISTINCT split) AS splits FROM read_parquet(?) GROUP BY prompt_id "
                       "HAVING count(DISTINCT split) > 1", [path])
    empty = query_rows(con, "SELECT sample_id, source, len(input_ids) AS length FROM read_parquet(?) "
                       "WHERE list_sum(loss_mask) = 0 OR len(loss_mask) <> len(input_ids)", [path])
    digests, table = verify_token_table(path), verify_table_digest(path)
    problems = []
    if n_dups:
        problems.append(f"{n_dups} duplicate sample ids ({name_rows(dups, n_dups)})")
    if leaks:
        problems.append(f"{len(leaks)} prompts appear in both train and eval ({name_rows(leaks)})")
    if empty:
        problems.append(f"{len(empty)} rows with an empty or misaligned loss mask ({name_rows(empty)})")
    if digests.mismatched:
        problems.append(f"{digests.mismatched} rows hold ids or a loss mask other than token_ids wrote "
                        f"({digests.names()})")
    if not digests.has_digest:
        problems.append(f"{path} has no {DIGEST_COLUMN} column (built from token rows written before they carried "
                        f"digests): an id edited since cannot be detected; re-materialize token_ids and {writer}")
    if not table.ok:
        problems.append(table.problem(path, writer))
    if rows == 0:
        problems.append("the corpus is empty")
    offending = [dict(r, problem="duplicate") for r in dups]
    offending += [dict(r, problem="split leak") for r in leaks[:SAMPLE]]
    offending += [dict(r, problem="empty mask") for r in empty[:SAMPLE]]
    offending += [dict(r, problem="digest differs") for r in digests.first]
    return dg.AssetCheckResult(
        passed=not problems,
        description="; ".join(problems) or f"{rows} unique samples, {train} train / {eval_} eval, every row "
                                            "matching its digest and the file its table digest",
        metadata={"rows": rows, "train": train, "eval": eval_, "duplicates": n_dups,
                  "split_leaks": len(leaks), "empty_masks": len(empty), "digest_mismatches": digests.mismatched,
                  "digests": "checked" if digests.has_digest else "none in this corpus",
                  "table_digest": "matches" if table.ok else "none" if table.recorded is None else "differs",
                  "columns_changed": ", ".join(table.changed) or "none",
                  "offending_rows": md_table(offending)},
    )


@dg.asset_check(asset=inventory, partitions_def=datasets_partitions, pool="duckdb",
                description="Every prompt has a response; lists the ones that do not, with why (a warning, not a gate).")
def responses_complete(context: dg.AssetCheckExecutionContext, storage: StorageResource) -> dg.AssetCheckResult:
    dataset = context.partition_key
    with storage.query() as con:
        has_table = con.execute("SELECT count(*) FROM duckdb_tables() WHERE database_name = 'meta' "
                                "AND table_name = 'unanswered'").fetchone()[0]
        if not has_table:
            return dg.AssetCheckResult(passed=True, severity=dg.AssetCheckSeverity.WARN,
                                       description="no unanswered-prompt table yet")
        by_reason = query_rows(con, "SELECT reason, count(*) AS prompts FROM meta.unanswered WHERE dataset = ? "
                               "GROUP BY reason ORDER BY prompts DESC, reason", [dataset])
        sample = query_rows(con, "SELECT prompt_id, reason, detail FROM meta.unanswered WHERE dataset = ? "
                            "ORDER BY prompt_id LIMIT ?", [dataset, SAMPLE])
    n = sum(r["prompts"] for r in by_reason)
    reasons = ", ".join(f"{r['reason']}: {r['prompts']}" for r in by_reason)
    return dg.AssetCheckResult(
        passed=n == 0, severity=dg.AssetCheckSeverity.WARN,
        description=f"{n} prompts without a response ({reasons}): {name_rows(sample, n)}" if n
        else "every prompt has a response",
        metadata={"unanswered": n, "by_reason": md_table(by_reason), "prompts": md_table(sample)},
    )


CORPUS_CHECKS = [token_budget, truncation_rate, corpus_integrity, responses_complete]
