"""Asset checks: DuckDB queries over the Parquet files and (read-only) metadata.duckdb.

Blocking checks fail their step, so nothing downstream in the same run or backfill is
built from bad data; the metadata of every check shows its figures and offending rows.
"""


import dagster as dg

from eagle3_assets.assets.corpus import merged_corpus
from eagle3_assets.assets.inventory import inventory
from eagle3_assets.assets.tokens import token_ids
from eagle3_assets.metadata import md_table
from eagle3_assets.partitions import datasets_partitions
from resources import DatasetSettings, StorageResource, TokenizerResource

SAMPLE = 10


def _rows(con, sql: str, params: list) -> list[dict]:
    cur = con.execute(sql, params)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r)) for r in cur.fetchall()]


@dg.asset_check(asset=token_ids, blocking=True, partitions_def=datasets_partitions, pool="duckdb",
                description="End-of-turn ids decode to the configured string, match the chat template's turn end "
                            "and end every stopped turn; "
                            "ids in vocabulary range; no special ids inside re-tokenized text.")
def special_tokens_valid(context: dg.AssetCheckExecutionContext, storage: StorageResource,
                         tokenizer: TokenizerResource) -> dg.AssetCheckResult:
    tok = tokenizer.load()
    path = str(storage.layout.tokens(context.partition_key))
    with storage.query() as con:
        return special_token_result(tok, con, path)


def special_token_result(tok, con, path: str) -> dg.AssetCheckResult:
    """The body of ``special_tokens_valid``: ``tok`` a ``TargetTokenizer``, ``con`` a DuckDB
    connection, ``path`` the token Parquet file (callable without a Dagster context)."""
    eot, eot_id = tok.end_of_turn, tok.end_of_turn_id
    decoded = tok.decode([eot_id])
    specials = sorted(tok.special_ids)
    turn_end = tok.template_turn_end()
    total = con.execute("SELECT count(*) FROM read_parquet(?)", [path]).fetchone()[0]
    wrong_end = _rows(con, """
        SELECT sample_id, source, input_ids[len(input_ids)] AS last_id FROM read_parquet(?)
        WHERE finish_reason = 'stop' AND (len(input_ids) = 0 OR input_ids[len(input_ids)] <> ?)""",
        [path, eot_id])
    out_of_range = _rows(con, """
        SELECT sample_id, source, list_min(input_ids) AS min_id, list_max(input_ids) AS max_id
        FROM read_parquet(?) WHERE list_min(input_ids) < 0 OR list_max(input_ids) >= ?""",
        [path, tok.vocab_size])
    special_in_text = _rows(con, """
        SELECT sample_id, source FROM read_parquet(?)
        WHERE built_from = 'retokenized' AND list_has_any(
            input_ids[prompt_len + 1 : len(input_ids) - CASE WHEN finish_reason = 'stop' THEN 1 ELSE 0 END],
            ?::INTEGER[])""",
        [path, specials])
    problems = []
    if decoded != eot:
        problems.append(f"end-of-turn id {eot_id} decodes to {decoded!r}, not {eot!r}")
    if turn_end is not None and turn_end[1] != eot_id:
        problems.append(f"the chat template closes assistant turns with {turn_end[0]!r} = id {turn_end[1]}, "
                        f"but end_of_turn is configured as {eot!r} = id {eot_id}")
    if wrong_end:
        seen = sorted({r["last_id"] for r in wrong_end if r["last_id"] is not None})
        names = ", ".join(f"{i} ({tok.decode([i])!r})" for i in seen[:5])
        problems.append(
            f"{len(wrong_end)} stopped turns end with id {names} instead of the end-of-turn "
            f"string {eot!r}, which is id {eot_id}"
        )
    if out_of_range:
        problems.append(f"{len(out_of_range)} rows hold ids outside [0, {tok.vocab_size})")
    if special_in_text:
        problems.append(f"{len(special_in_text)} re-tokenized rows hold special ids inside their text")
    offending = [dict(r, problem="wrong end") for r in wrong_end[:SAMPLE]]
    offending += [dict(r, problem="id out of range") for r in out_of_range[:SAMPLE]]
    offending += [dict(r, problem="special id in text") for r in special_in_text[:SAMPLE]]
    return dg.AssetCheckResult(
        passed=not problems,
        description="; ".join(problems) or f"{total} rows end their turns with {eot!r} = {eot_id}",
        metadata={
            "rows": total, "end_of_turn": eot, "end_of_turn_id": eot_id, "decoded": decoded,
            "template_turn_end": "unknown" if turn_end is None else f"{turn_end[0]} = {turn_end[1]}",
            "vocab_size": tok.vocab_size, "wrong_end": len(wrong_end), "out_of_range": len(out_of_range),
            "special_in_text": len(special_in_text), "offending_rows": md_table(offending),
        },
    )


@dg.asset_check(asset=token_ids, blocking=True, partitions_def=datasets_partitions, pool="duckdb",
                description="Re-tokenized text agrees with native ids at or above the threshold "
                            "(blocks only when the dataset holds re-tokenized rows).")
def reconstruction_consistency(context: dg.AssetCheckExecutionContext, storage: StorageResource,
                               dataset_settings: DatasetSettings) -> dg.AssetCheckResult:
    path = str(storage.layout.tokens(context.partition_key))
    threshold = dataset_settings.consistency_threshold
    with storage.query() as con:
        per_source = _rows(con, """
            SELECT source, count(*) AS rows,
                   count(*) FILTER (WHERE native_ids) AS native_rows,
                   count(*) FILTER (WHERE NOT native_ids) AS retokenized_rows,
                   sum(retok_matched) FILTER (WHERE native_ids) AS matched,
                   sum(retok_total) FILTER (WHERE native_ids) AS total,
                   avg(retok_exact::INTEGER) FILTER (WHERE native_ids) AS exact_rate
            FROM read_parquet(?) GROUP BY source ORDER BY source""", [path])
        worst = _rows(con, """
            SELECT sample_id, source, retok_matched, retok_total, retok_diff FROM read_parquet(?)
            WHERE native_ids AND NOT retok_exact ORDER BY retok_matched / greatest(retok_total, 1) LIMIT ?""",
            [path, SAMPLE])
    matched = sum(r["matched"] or 0 for r in per_source)
    total = sum(r["total"] or 0 for r in per_source)
    native = sum(r["native_rows"] for r in per_source)
    retokenized = sum(r["retokenized_rows"] for r in per_source)
    exact = sum((r["exact_rate"] or 0) * r["native_rows"] for r in per_source) / native if native else None
    agreement = matched / total if total else None
    for r in per_source:
        r["agreement"] = (r["matched"] or 0) / r["total"] if r["total"] else None
    meta = {
        "token_agreement": agreement, "exact_sequence_rate": exact, "mismatch_rate": None if exact is None else 1 - exact,
        "threshold": threshold, "native_rows": native, "retokenized_rows": retokenized,
        "by_source": md_table(per_source), "worst_rows": md_table(worst),
    }
    figure = "n/a" if agreement is None else f"{agreement:.4%}"
    if retokenized == 0:
        return dg.AssetCheckResult(passed=True, metadata=meta,
                                   description=f"native ids only; re-tokenization agreement {figure} (reported, not gating)")
    if agreement is None:
        return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.WARN, metadata=meta,
                                   description=f"{retokenized} re-tokenized rows but no native rows to calibrate against")
    return dg.AssetCheckResult(passed=agreement >= threshold, metadata=meta,
                               description=f"token agreement {figure} vs threshold {threshold:.2%}")


@dg.asset_check(asset=inventory, blocking=True, partitions_def=datasets_partitions, pool="duckdb",
                description="Completion tokens of the dataset are within its budget.")
def token_budget(context: dg.AssetCheckExecutionContext, storage: StorageResource) -> dg.AssetCheckResult:
    with storage.query() as con:
        rows = _rows(con, "SELECT source, completion_tokens, budget_tokens, budget_used, budget_remaining "
                          "FROM meta.inventory WHERE dataset = ? ORDER BY source = 'all', source",
                     [context.partition_key])
    total = next((r for r in rows if r["source"] == "all"), None)
    if total is None:
        return dg.AssetCheckResult(passed=False, description="no inventory row for this dataset")
    ok = total["budget_used"] <= total["budget_tokens"]
    return dg.AssetCheckResult(
        passed=ok,
        description=f"{total['budget_used']:,} of {total['budget_tokens']:,} tokens used",
        metadata={"budget_tokens": total["budget_tokens"], "budget_used": total["budget_used"],
                  "budget_remaining": total["budget_remaining"], "by_source": md_table(rows)},
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
                description="No duplicate samples, train/eval split disjoint by prompt, no empty assistant mask.")
def corpus_integrity(context: dg.AssetCheckExecutionContext, storage: StorageResource) -> dg.AssetCheckResult:
    path = str(storage.layout.corpus(context.partition_key))
    with storage.query() as con:
        rows, train, eval_ = con.execute(
            "SELECT count(*), count(*) FILTER (WHERE split = 'train'), count(*) FILTER (WHERE split = 'eval') "
            "FROM read_parquet(?)", [path]).fetchone()
        dups = _rows(con, "SELECT sample_id, count(*) AS copies FROM read_parquet(?) GROUP BY sample_id "
                          "HAVING count(*) > 1 LIMIT ?", [path, SAMPLE])
        n_dups = con.execute("SELECT count(*) FROM (SELECT sample_id FROM read_parquet(?) GROUP BY sample_id "
                             "HAVING count(*) > 1)", [path]).fetchone()[0]
        leaks = _rows(con, "SELECT prompt_id, list(DISTINCT split) AS splits FROM read_parquet(?) GROUP BY prompt_id "
                           "HAVING count(DISTINCT split) > 1", [path])
        empty = _rows(con, "SELECT sample_id, source, len(input_ids) AS length FROM read_parquet(?) "
                           "WHERE list_sum(loss_mask) = 0 OR len(loss_mask) <> len(input_ids)", [path])
    problems = []
    if n_dups:
        problems.append(f"{n_dups} duplicate sample ids")
    if leaks:
        problems.append(f"{len(leaks)} prompts appear in both train and eval")
    if empty:
        problems.append(f"{len(empty)} rows with an empty or misaligned loss mask")
    if rows == 0:
        problems.append("the corpus is empty")
    offending = [dict(r, problem="duplicate") for r in dups]
    offending += [dict(r, problem="split leak") for r in leaks[:SAMPLE]]
    offending += [dict(r, problem="empty mask") for r in empty[:SAMPLE]]
    return dg.AssetCheckResult(
        passed=not problems,
        description="; ".join(problems) or f"{rows} unique samples, {train} train / {eval_} eval",
        metadata={"rows": rows, "train": train, "eval": eval_, "duplicates": n_dups,
                  "split_leaks": len(leaks), "empty_masks": len(empty), "offending_rows": md_table(offending)},
    )


ALL_CHECKS = [special_tokens_valid, reconstruction_consistency, token_budget, truncation_rate, corpus_integrity]
