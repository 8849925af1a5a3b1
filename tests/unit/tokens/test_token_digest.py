"""Token rows are tamper-evident: an id edited in ``tokens/<dataset>.parquet`` after ``token_ids``
wrote it fails ``token_rows_intact``, named by dataset and sample id; the other token checks, which
read figures stored at build time, do not see such an edit (shown here too). The table is too: a row
deleted, duplicated or moved, an edited ``prompt_len`` or ``split`` fails its check in the token
file and the corpus, though every row's digest still holds; so does a reply edited in the response
file after its token row was built, and a file whose digests were removed."""

import json

import dagster as dg
import duckdb
import polars as pl
import pyarrow.parquet as pq
import pytest

from eagle3_assets.corpus.checks import corpus_integrity_result
from eagle3_assets.corpus.merge import merge_corpus
from eagle3_assets.tokens.checks import special_token_result, token_digest_result
from eagle3_assets.tokens.digest import (
    DIGEST_COLUMN,
    TABLE_KEY,
    row_digest,
    verify_table_digest,
    verify_token_table,
    write_digested_parquet,
)
from eagle3_assets.tokens.rows import build_token_row
from eagle3_assets.tokens.table import write_token_table

REPLIES = ["The capital of France is Paris, a city on the Seine.", "Two and two make four, as always.",
           "Water boils at one hundred degrees at sea level."]


def _native_table(tok, path):
    """Token rows with native ids (the backend's), written by the project's writer."""
    rows = []
    for i, text in enumerate(REPLIES):
        msgs = [{"role": "user", "content": f"Question {i}?"}]
        prompt = tok.render_prompt(msgs)
        out = tok.retokenize_completion(text, "stop", prompt_ids=prompt)
        r = {"sample_id": f"s{i}", "dataset": "facts", "prompt_id": f"p{i}", "source": "sglang", "prompt_ids": prompt,
             "output_ids": out, "text": text, "reasoning": None, "finish_reason": "stop"}
        rows.append(build_token_row(r, msgs, tok))
    write_token_table(rows, path)
    return rows


def _edit(path, sample_id: str, new_id: int | None = None) -> tuple[int, int]:
    """Change the id in the middle of ``sample_id``'s reply (to ``new_id``, else to the id + 1)."""
    frame = pl.read_parquet(path)
    row = frame.filter(pl.col("sample_id") == sample_id).row(0, named=True)
    ids = list(row["input_ids"])
    pos = row["prompt_len"] + row["completion_len"] // 2
    old = ids[pos]
    ids[pos] = old + 1 if new_id is None else new_id
    frame = frame.with_columns(pl.when(pl.col("sample_id") == sample_id).then(pl.Series([ids] * frame.height))
                               .otherwise(pl.col("input_ids")).cast(pl.List(pl.Int32)).alias("input_ids"))
    frame.write_parquet(path)
    return old, ids[pos]


def _keeping_digests(path, change) -> None:
    """Rewrite the file through ``change`` (a polars frame in, one out) and put its table digest
    back: an edit that leaves every digest the writer stored in place."""
    recorded = pq.ParquetFile(str(path)).metadata.metadata[TABLE_KEY.encode()]
    table = change(pl.read_parquet(path)).to_arrow()
    pq.write_table(table.replace_schema_metadata({TABLE_KEY: recorded}), path)


def test_the_writer_stores_a_digest_the_check_recomputes(target_tokenizer, tmp_path):
    path = tmp_path / "facts.parquet"
    rows = _native_table(target_tokenizer, path)
    stored = pl.read_parquet(path)[DIGEST_COLUMN].to_list()
    assert stored == [row_digest(r["input_ids"], r["loss_mask"]) for r in rows] and len(set(stored)) == 3
    result = token_digest_result(path)
    assert result.passed and result.description == ("all 3 rows match the digest written with them, the file its "
                                                    "table digest")
    recorded = json.loads(pq.ParquetFile(str(path)).metadata.metadata[TABLE_KEY.encode()])
    assert recorded["rows"] == 3 and {"prompt_len", "input_ids", "split"} & set(recorded["columns"]) == {"prompt_len",
                                                                                                         "input_ids"}
    _keeping_digests(path, lambda f: f)  # written again by another writer, in other batches: the same digest
    assert verify_table_digest(path).ok


def test_an_id_edited_in_a_native_reply_fails_naming_the_row(target_tokenizer, tmp_path):
    tok = target_tokenizer
    path = tmp_path / "facts.parquet"
    _native_table(tok, path)
    old, new = _edit(path, "s1")
    assert new == old + 1
    with duckdb.connect() as con:  # the stored figures cannot see it: this is what the digest is for
        assert special_token_result(tok, con, str(path)).passed
    result = token_digest_result(path)
    assert not result.passed and result.severity == dg.AssetCheckSeverity.ERROR
    assert result.description.startswith("1 of 3 rows hold ids or a loss mask other than token_ids wrote "
                                         "(their row_digest differs): facts/s1; ")
    # the end-of-turn id put inside a reply: caught the same way
    _edit(path, "s2", tok.end_of_turn_id)
    assert verify_token_table(path).names() == "facts/s1, facts/s2"
    assert "2 of 3 rows" in token_digest_result(path).description


def test_a_mask_edit_is_caught_and_many_rows_are_named_by_the_first_few(target_tokenizer, tmp_path):
    path = tmp_path / "facts.parquet"
    _native_table(target_tokenizer, path)
    frame = pl.read_parquet(path)
    frame = frame.with_columns(pl.col("loss_mask").list.eval(pl.lit(0, pl.Int8)).alias("loss_mask"))
    frame.write_parquet(path)
    report = verify_token_table(path, keep=2, batch_rows=2)  # across batches
    assert report.mismatched == 3 and report.names(2) == "facts/s0, facts/s1 and 1 more"


def test_a_table_without_its_digests_fails_naming_what_to_rematerialize(target_tokenizer, tmp_path):
    """Removing the evidence does not turn the guard off: no row digests, or no table digest (a tool
    that rewrote the file), fails the blocking check and names the asset to run again."""
    path = tmp_path / "facts.parquet"
    _native_table(target_tokenizer, path)
    _keeping_digests(path, lambda f: f.drop(DIGEST_COLUMN))
    result = token_digest_result(path, writer="token_ids[facts]")
    assert not result.passed and result.severity == dg.AssetCheckSeverity.ERROR
    assert result.description.startswith(
        f"{path} has no row_digest column (written before rows carried digests): an id edited after it was written "
        "cannot be detected in its 3 rows; re-materialize token_ids[facts]; ")
    assert "columns row_digest are gone" in result.description
    _native_table(target_tokenizer, path)
    pl.read_parquet(path).write_parquet(path)  # the same rows, rewritten by a tool that keeps no footer
    result = token_digest_result(path, writer="token_ids[facts]")
    assert not result.passed and result.description == (
        f"{path} carries no table digest (written before files had one, or rewritten by another tool): a row deleted, "
        "duplicated, moved or edited cannot be detected; re-materialize token_ids[facts]")


def _swap_rows(frame: pl.DataFrame, columns: list[str]) -> pl.DataFrame:
    """Rows 0 and 1 exchange ``columns`` (whole rows when every column)."""
    swapped = {c: [frame[c][1], frame[c][0], *frame[c][2:]] for c in columns}
    return frame.with_columns(*(pl.Series(c, v, dtype=frame.schema[c]) for c, v in swapped.items()))


EDITS = {  # what each does to the file; none changes a row's ids or mask against its own row_digest
    "deleted": (lambda f: f.slice(1), "it holds 2 rows where {w} wrote 3 (rows deleted or added)"),
    "duplicated": (lambda f: pl.concat([f, f.slice(1, 1)]), "it holds 4 rows where {w} wrote 3 (rows deleted or added)"),
    "swapped": (lambda f: _swap_rows(f, f.columns), "differ from what it wrote (sample_id among them: rows moved, swapped "
                                                     "or relabelled)"),
    "ids swapped": (lambda f: _swap_rows(f, ["input_ids", "loss_mask", DIGEST_COLUMN]),
                    "columns input_ids, loss_mask, row_digest differ from what it wrote"),
    "prompt_len": (lambda f: f.with_columns(pl.col("prompt_len") + (pl.col("sample_id") == "s2").cast(pl.Int32)),
                   "column prompt_len differs from what it wrote"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edit_every_row_digest_misses_fails_in_the_token_file_and_the_corpus(target_tokenizer, tmp_path, edit):
    change, said = EDITS[edit]
    tokens = tmp_path / "facts.parquet"
    _native_table(target_tokenizer, tokens)
    corpus_path = tmp_path / "corpus.parquet"
    write_digested_parquet(merge_corpus(pl.read_parquet(tokens), eval_fraction=0.5)[0], corpus_path)
    for path, writer in ((tokens, "token_ids[facts]"), (corpus_path, "merged_corpus[facts]")):
        _keeping_digests(path, change)
        assert verify_token_table(path).mismatched == 0  # every row still matches its own digest
        if path == tokens:
            result = token_digest_result(path, writer=writer)
        else:
            with duckdb.connect() as con:
                result = corpus_integrity_result(con, str(path), writer=writer)
        assert not result.passed and f"{path} is not the table {writer} wrote: " in result.description
        assert f"{said.format(w=writer)}; re-materialize {writer}" in result.description, result.description


def test_a_relabelled_split_fails_the_corpus(target_tokenizer, tmp_path):
    """Each prompt holds one sample here, so no split leak shows: only the table digest sees it."""
    tokens = tmp_path / "facts.parquet"
    _native_table(target_tokenizer, tokens)
    path = tmp_path / "corpus.parquet"
    write_digested_parquet(merge_corpus(pl.read_parquet(tokens), eval_fraction=0.5)[0], path)
    _keeping_digests(path, lambda f: f.with_columns(
        pl.when(pl.col("sample_id") == "s0").then(pl.lit("eval")).otherwise(pl.col("split")).alias("split")
        if f.filter(pl.col("sample_id") == "s0")["split"][0] == "train" else
        pl.when(pl.col("sample_id") == "s0").then(pl.lit("train")).otherwise(pl.col("split")).alias("split")))
    with duckdb.connect() as con:
        result = corpus_integrity_result(con, str(path), writer="merged_corpus[facts]")
    assert not result.passed and result.description == (
        f"{path} is not the table merged_corpus[facts] wrote: column split differs from what it wrote; "
        "re-materialize merged_corpus[facts]")


def test_the_corpus_keeps_the_digests_and_its_check_names_an_edited_row(target_tokenizer, tmp_path):
    """merged_corpus carries the rows' digests; corpus_integrity recomputes them, so an id edited in
    the corpus (what hidden_states reads) fails too, the row named."""
    tokens = tmp_path / "facts.parquet"
    _native_table(target_tokenizer, tokens)
    corpus, _ = merge_corpus(pl.read_parquet(tokens), eval_fraction=0.0)
    path = tmp_path / "corpus.parquet"
    write_digested_parquet(corpus, path)
    with duckdb.connect() as con:
        ok = corpus_integrity_result(con, str(path))
    assert ok.passed and ok.description.endswith("every row matching its digest and the file its table digest")
    _edit(path, "s0")
    with duckdb.connect() as con:
        bad = corpus_integrity_result(con, str(path))
    assert not bad.passed
    assert bad.description.startswith("1 rows hold ids or a loss mask other than token_ids wrote (facts/s0); ")


def test_a_reply_edited_after_token_ids_shows_its_row_stale(target_tokenizer, layout, monkeypatch):
    """The token_ids asset records each row's reply line; a reply text edited in the response file
    afterwards (the ids are the backend's, so no other check moves beyond an agreement figure)
    fails token_rows_intact, the row named, until token_ids runs again."""
    from eagle3_assets.generation.response_store import ResponseStore
    from eagle3_assets.partitions import datasets_partitions
    from eagle3_assets.prompts.assets import prompts
    from eagle3_assets.resources import DatasetSettings, StorageResource, TargetResource
    from eagle3_assets.tokens.assets import token_ids
    from eagle3_assets.tokens.checks import token_rows_intact
    from tests.conftest import write_jsonl

    tok, replies = target_tokenizer, []
    monkeypatch.setattr(TargetResource, "load_tokenizer", lambda self: tok)  # the session's, already loaded
    write_jsonl(layout.prompt_source("facts"), [{"id": f"p{i}", "messages": [{"role": "user", "content": f"Question {i}?"}]}
                                                for i in range(3)])
    for i, text in enumerate(REPLIES):
        prompt = tok.render_prompt([{"role": "user", "content": f"Question {i}?"}])
        replies.append({"sample_id": f"s{i}", "dataset": "facts", "prompt_id": f"p{i}", "source": "sglang",
                        "prompt_ids": prompt, "output_ids": tok.retokenize_completion(text, "stop", prompt_ids=prompt),
                        "text": text, "reasoning": None, "finish_reason": "stop"})
    store = ResponseStore(layout.responses_dir("facts"))
    with store.writer("sglang") as out:
        out.write_batch(replies)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(datasets_partitions.name, ["facts"])
        [check] = dg.materialize([prompts, token_ids, token_rows_intact], partition_key="facts", instance=instance,
                                 resources={"storage": StorageResource(), "target": TargetResource(),
                                            "dataset_settings": DatasetSettings()}
                                 ).get_asset_check_evaluations()
    assert check.passed and check.description.endswith("every reply as it was built from"), check.description
    lines = store.path("sglang").read_text().splitlines()
    edited = json.loads(lines[1])
    edited["text"] = edited["text"].replace("four", "five")
    store.path("sglang").write_text("\n".join([lines[0], json.dumps(edited), lines[2]]) + "\n")
    result = token_digest_result(layout.tokens("facts"), layout.responses_dir("facts"), writer="token_ids[facts]")
    assert not result.passed and result.description == (
        f"1 of 3 rows are stale: their reply in {layout.responses_dir('facts')} was edited or removed after token_ids "
        "built them (facts/s1 (sglang)); re-materialize token_ids[facts]")


def test_the_end_of_turn_pass_counts_only_the_turns_that_stopped(target_tokenizer, tmp_path):
    """A row cut by length holds no end-of-turn id: the passing description does not count it among
    the turns that end with one."""
    tok, rows = target_tokenizer, []
    for i, (text, finish) in enumerate([(REPLIES[0], "stop"), (REPLIES[1], "stop"), (REPLIES[2], "length")]):
        prompt = tok.render_prompt([{"role": "user", "content": f"Question {i}?"}])
        out = tok.retokenize_completion(text, finish, prompt_ids=prompt)
        rows.append(build_token_row({"sample_id": f"s{i}", "dataset": "facts", "prompt_id": f"p{i}", "source": "sglang",
                                     "prompt_ids": prompt, "output_ids": out, "text": text, "reasoning": None,
                                     "finish_reason": finish}, None, tok))
    assert rows[2]["input_ids"][-1] != tok.end_of_turn_id
    path = tmp_path / "facts.parquet"
    write_token_table(rows, path)
    with duckdb.connect() as con:
        result = special_token_result(tok, con, str(path))
    assert result.passed and result.description == (
        f"2 stopped turns end with {tok.end_of_turn!r} = {tok.end_of_turn_id}; 1 rows did not stop (1 cut by length) "
        "and need not end with it")


def test_the_table_digest_does_not_depend_on_batches_and_sees_a_moved_null():
    from eagle3_assets.tokens.digest import table_digest

    frame = pl.DataFrame({"a": [[1, 2], None, [3], []], "s": ["x", None, "yz", ""], "b": [True, None, False, True],
                          "f": [1.5, None, 2.0, 0.0]}, schema_overrides={"a": pl.List(pl.Int32)})
    t = frame.to_arrow()
    whole = table_digest(t.to_batches(), t.column_names)
    assert table_digest(t.to_batches(max_chunksize=1), t.column_names) == whole
    moved = frame.with_columns(pl.Series("s", [None, "x", "yz", ""])).to_arrow()
    changed = table_digest(moved.to_batches(max_chunksize=3), moved.column_names)["columns"]
    assert [c for c in whole["columns"] if changed[c] != whole["columns"][c]] == ["s"]
