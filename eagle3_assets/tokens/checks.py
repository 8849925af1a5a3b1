"""Checks on ``token_ids``: DuckDB queries over the token Parquet file.

Both block: bad ids or drifting re-tokenization stop the run before the corpus, and the GPUs
after it, see the data. Each check's metadata shows its figures and offending rows.
"""

import dagster as dg

from eagle3_assets.metadata import md_table
from eagle3_assets.partitions import datasets_partitions
from eagle3_assets.querying import SAMPLE, name_rows, query_rows
from eagle3_assets.resources import DatasetSettings, StorageResource, TargetResource
from eagle3_assets.tokens.assets import token_ids


@dg.asset_check(asset=token_ids, blocking=True, partitions_def=datasets_partitions, pool="duckdb",
                description="End-of-turn ids decode to the configured string, match the chat template's turn end "
                            "and end every stopped turn; "
                            "ids in vocabulary range; no special ids inside re-tokenized text beyond literal special "
                            "strings (those are reported as a warning).")
def special_tokens_valid(context: dg.AssetCheckExecutionContext, storage: StorageResource,
                         target: TargetResource) -> dg.AssetCheckResult:
    tok = target.load_tokenizer()
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
    ended = dict(con.execute("SELECT coalesce(finish_reason, 'none'), count(*) FROM read_parquet(?) GROUP BY ALL",
                             [path]).fetchall())
    stopped = ended.pop("stop", 0)
    wrong_end = query_rows(con, """
        SELECT dataset, sample_id, source, input_ids[len(input_ids)] AS last_id FROM read_parquet(?)
        WHERE finish_reason = 'stop' AND (len(input_ids) = 0 OR input_ids[len(input_ids)] <> ?)""",
        [path, eot_id])
    out_of_range = query_rows(con, """
        SELECT dataset, sample_id, source, list_min(input_ids) AS min_id, list_max(input_ids) AS max_id
        FROM read_parquet(?) WHERE list_min(input_ids) < 0 OR list_max(input_ids) >= ?""",
        [path, tok.vocab_size])
    in_text = query_rows(con, """
        WITH sp AS (SELECT ?::INTEGER[] AS ids)
        SELECT dataset, sample_id, source, literal_specials, len(list_filter(
            input_ids[prompt_len + 1 : len(input_ids) - CASE WHEN finish_reason = 'stop' THEN 1 ELSE 0 END],
            x -> list_contains(sp.ids, x))) AS special_ids
        FROM read_parquet(?), sp WHERE built_from = 'retokenized'""",
        [specials, path])
    special_in_text = [r for r in in_text if r["special_ids"] > (r["literal_specials"] or 0)]
    literal_rows = [r for r in in_text if (r["literal_specials"] or 0) > 0]
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
            f"string {eot!r}, which is id {eot_id} ({name_rows(wrong_end)})"
        )
    if out_of_range:
        problems.append(f"{len(out_of_range)} rows hold ids outside [0, {tok.vocab_size}) ({name_rows(out_of_range)})")
    if special_in_text:
        problems.append(f"{len(special_in_text)} re-tokenized rows hold special ids inside their text that no "
                        f"literal special string explains ({name_rows(special_in_text)})")
    warning = (f"{len(literal_rows)} re-tokenized rows write special-token strings literally in their text "
               f"({sum(r['literal_specials'] for r in literal_rows)} in all); the target's tokenizer encodes them "
               "as special ids, as it would for any caller (see build_notes)") if literal_rows else ""
    offending = [dict(r, problem="wrong end") for r in wrong_end[:SAMPLE]]
    offending += [dict(r, problem="id out of range") for r in out_of_range[:SAMPLE]]
    offending += [dict(r, problem="special id in text") for r in special_in_text[:SAMPLE]]
    offending += [dict(r, problem="literal special string") for r in literal_rows[:SAMPLE]]
    metadata = {
        "rows": total, "stopped_rows": stopped, "end_of_turn": eot, "end_of_turn_id": eot_id, "decoded": decoded,
        "template_turn_end": "unknown" if turn_end is None else f"{turn_end[0]} = {turn_end[1]}",
        "vocab_size": tok.vocab_size, "wrong_end": len(wrong_end), "out_of_range": len(out_of_range),
        "special_in_text": len(special_in_text), "literal_special_rows": len(literal_rows),
        "offending_rows": md_table(offending),
    }
    if not problems and warning:  # reported, not blocking: the ids are what the tokenizer makes of the text
        return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.WARN, description=warning,
                                   metadata=metadata)
    return dg.AssetCheckResult(
        passed=not problems,
        description="; ".join(problems + ([warning] if warning else []))
        or f"{stopped} stopped turns end with {eot!r} = {eot_id}" + _not_stopped(ended),
        metadata=metadata,
    )


def _not_stopped(ended: dict) -> str:
    """The rows a pass does not vouch for: those that did not stop (cut by length) end where they were cut."""
    if not ended:
        return ""
    why = ", ".join(f"{n} {'cut by length' if r == 'length' else f'ended by {r!r}'}" for r, n in sorted(ended.items()))
    return f"; {sum(ended.values())} rows did not stop ({why}) and need not end with it"


@dg.asset_check(asset=token_ids, blocking=True, partitions_def=datasets_partitions, pool="duckdb",
                description="Re-tokenized text agrees with native ids at or above the threshold "
                            "(blocks only when the dataset holds re-tokenized rows); tool-call replies rebuilt by the "
                            "chat template are measured apart, and gate too when they have native rows to compare.")
def reconstruction_consistency(context: dg.AssetCheckExecutionContext, storage: StorageResource,
                               dataset_settings: DatasetSettings) -> dg.AssetCheckResult:
    path = str(storage.layout.tokens(context.partition_key))
    threshold = dataset_settings.consistency_threshold
    with storage.query() as con:
        per_source = query_rows(con, """
            SELECT source, count(*) AS rows,
                   count(*) FILTER (WHERE native_ids) AS native_rows,
                   count(*) FILTER (WHERE NOT native_ids) AS retokenized_rows,
                   sum(retok_matched) FILTER (WHERE native_ids) AS matched,
                   sum(retok_total) FILTER (WHERE native_ids) AS total,
                   avg(retok_exact::INTEGER) FILTER (WHERE native_ids) AS exact_rate,
                   count(*) FILTER (WHERE native_ids AND tool_calls > 0) AS tool_call_native_rows,
                   count(*) FILTER (WHERE NOT native_ids AND tool_calls > 0) AS tool_call_rebuilt_rows,
                   sum(retok_matched) FILTER (WHERE native_ids AND tool_calls > 0) AS tool_call_matched,
                   sum(retok_total) FILTER (WHERE native_ids AND tool_calls > 0) AS tool_call_total,
                   avg(retok_exact::INTEGER) FILTER (WHERE native_ids AND tool_calls > 0) AS tool_call_exact_rate
            FROM read_parquet(?) GROUP BY source ORDER BY source""", [path])
        worst = query_rows(con, """
            SELECT dataset, sample_id, source, retok_matched, retok_total, retok_diff FROM read_parquet(?)
            WHERE native_ids AND NOT retok_exact ORDER BY retok_matched / greatest(retok_total, 1) LIMIT ?""",
            [path, SAMPLE])
        inexact = con.execute("SELECT count(*) FROM read_parquet(?) WHERE native_ids AND NOT retok_exact",
                              [path]).fetchone()[0]
    matched = sum(r["matched"] or 0 for r in per_source)
    total = sum(r["total"] or 0 for r in per_source)
    native = sum(r["native_rows"] for r in per_source)
    retokenized = sum(r["retokenized_rows"] for r in per_source)
    exact = sum((r["exact_rate"] or 0) * r["native_rows"] for r in per_source) / native if native else None
    agreement = matched / total if total else None
    for r in per_source:
        r["agreement"] = (r["matched"] or 0) / r["total"] if r["total"] else None
        r["tool_call_agreement"] = (r["tool_call_matched"] or 0) / r["tool_call_total"] if r["tool_call_total"] else None
    calls = _tool_call_figures(per_source)
    meta = {
        "token_agreement": agreement, "exact_sequence_rate": exact, "mismatch_rate": None if exact is None else 1 - exact,
        "threshold": threshold, "native_rows": native, "retokenized_rows": retokenized, **calls,
        "by_source": md_table(per_source), "worst_rows": md_table(worst),
    }
    figure = "n/a" if agreement is None else f"{agreement:.4%}"
    tool_line = _tool_call_line(calls)
    if retokenized == 0:
        return dg.AssetCheckResult(passed=True, metadata=meta, description=(
            f"native ids only; re-tokenization agreement {figure} (reported, not gating){tool_line}"))
    if agreement is None:
        return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.WARN, metadata=meta,
                                   description=f"{retokenized} re-tokenized rows but no native rows to calibrate against"
                                               f"{tool_line}")
    tool_agreement = calls["tool_call_token_agreement"]
    tools_ok = not calls["tool_call_rebuilt_rows"] or tool_agreement is None or tool_agreement >= threshold
    passed = agreement >= threshold and tools_ok
    worst_line = f"; least agreeing rows: {name_rows(worst, inexact)}" if worst and not passed else ""
    return dg.AssetCheckResult(passed=passed, metadata=meta,
                               description=f"token agreement {figure} vs threshold {threshold:.2%}{tool_line}{worst_line}")


def _tool_call_figures(per_source: list[dict]) -> dict:
    """Tool-call replies apart: rebuilt by the chat template, their agreement is its own figure."""
    native = sum(r["tool_call_native_rows"] for r in per_source)
    matched = sum(r["tool_call_matched"] or 0 for r in per_source)
    total = sum(r["tool_call_total"] or 0 for r in per_source)
    exact = sum((r["tool_call_exact_rate"] or 0) * r["tool_call_native_rows"] for r in per_source)
    return {"tool_call_native_rows": native, "tool_call_rebuilt_rows": sum(r["tool_call_rebuilt_rows"] for r in per_source),
            "tool_call_token_agreement": matched / total if total else None,
            "tool_call_exact_rate": exact / native if native else None}


def _tool_call_line(calls: dict) -> str:
    if not calls["tool_call_native_rows"] and not calls["tool_call_rebuilt_rows"]:
        return ""
    if calls["tool_call_token_agreement"] is None:
        return (f"; {calls['tool_call_rebuilt_rows']} tool-call replies rebuilt by the chat template, none with native "
                "ids to calibrate them against")
    return (f"; tool-call replies: token agreement {calls['tool_call_token_agreement']:.4%}, exact "
            f"{calls['tool_call_exact_rate']:.2%} on {calls['tool_call_native_rows']} rows with native ids "
            f"({calls['tool_call_rebuilt_rows']} rebuilt from structured calls)")


@dg.asset_check(asset=token_ids, blocking=True, partitions_def=datasets_partitions,
                description="The table is the one token_ids wrote: every row's ids and loss mask match its stored "
                            "row_digest (an edit fails, named by dataset and sample id); the file's table digest "
                            "matches (a row deleted, duplicated or moved, or any column edited, prompt_len among them, "
                            "fails); every row's reply is still in the response files as it was built from (an edited "
                            "reply shows its row stale). A file without its digests fails, naming what to re-materialize.")
def token_rows_intact(context: dg.AssetCheckExecutionContext, storage: StorageResource) -> dg.AssetCheckResult:
    dataset = context.partition_key
    return token_digest_result(storage.layout.tokens(dataset), storage.layout.responses_dir(dataset),
                               writer=f"token_ids[{dataset}]")


def token_digest_result(path, responses_dir=None, writer: str = "token_ids") -> dg.AssetCheckResult:
    """The body of ``token_rows_intact`` for the token file at ``path``; its replies' staleness is
    judged against the response files under ``responses_dir`` when given."""
    from eagle3_assets.generation.response_store import ResponseStore
    from eagle3_assets.tokens.digest import (
        DIGEST_COLUMN,
        RESPONSE_DIGEST_COLUMN,
        stale_rows,
        verify_table_digest,
        verify_token_table,
    )

    report, table = verify_token_table(path), verify_table_digest(path)
    stale = None
    if responses_dir is not None:
        stale = stale_rows(path, (line for _, _, line in ResponseStore(responses_dir).iter_lines()))
    problems = []
    if not report.has_digest:
        problems.append(f"{path} has no {DIGEST_COLUMN} column (written before rows carried digests): an id edited after "
                        f"it was written cannot be detected in its {report.rows:,} rows; re-materialize {writer}")
    if report.mismatched:
        problems.append(f"{report.mismatched:,} of {report.rows:,} rows hold ids or a loss mask other than token_ids "
                        f"wrote (their {DIGEST_COLUMN} differs): {report.names()}")
    if not table.ok:
        problems.append(table.problem(path, writer))
    if stale is not None and not stale.has_column:
        problems.append(f"{path} has no {RESPONSE_DIGEST_COLUMN} column (written before rows carried one): a reply "
                        f"edited in {responses_dir} after its row was built cannot be detected; re-materialize {writer}")
    elif stale is not None and stale.unrecorded:
        problems.append(f"{stale.unrecorded:,} rows carry no {RESPONSE_DIGEST_COLUMN}: re-materialize {writer}")
    if stale is not None and stale.stale:
        problems.append(f"{stale.stale:,} of {stale.rows:,} rows are stale: their reply in {responses_dir} was edited "
                        f"or removed after token_ids built them ({stale.names()}); re-materialize {writer}")
    meta = {"rows": report.rows, "mismatched": report.mismatched, "path": dg.MetadataValue.path(str(path)),
            "table_digest": "matches" if table.ok else "none" if table.recorded is None else "differs",
            "columns_changed": ", ".join(table.changed) or "none",
            "stale_rows": None if stale is None else stale.stale,
            "offending_rows": md_table(report.first + ([] if stale is None else [dict(r, problem="stale reply")
                                                                                for r in stale.first]))}
    if problems:
        return dg.AssetCheckResult(passed=False, metadata=meta, description="; ".join(problems))
    replies = "" if stale is None else ", every reply as it was built from"
    return dg.AssetCheckResult(passed=True, metadata=meta, description=(
        f"all {report.rows:,} rows match the digest written with them, the file its table digest{replies}"))


TOKEN_CHECKS = [special_tokens_valid, reconstruction_consistency, token_rows_intact]
