"""Token rows are tamper-evident: an id edited in ``tokens/<dataset>.parquet`` after ``token_ids``
wrote it fails ``token_rows_intact``, named by dataset and sample id; the other token checks, which
read figures stored at build time, do not see such an edit (shown here too)."""

import dagster as dg
import duckdb
import polars as pl

from eagle3_assets.tokens.checks import special_token_result, token_digest_result
from eagle3_assets.tokens.digest import DIGEST_COLUMN, row_digest, verify_token_table
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


def test_the_writer_stores_a_digest_the_check_recomputes(target_tokenizer, tmp_path):
    path = tmp_path / "facts.parquet"
    rows = _native_table(target_tokenizer, path)
    stored = pl.read_parquet(path)[DIGEST_COLUMN].to_list()
    assert stored == [row_digest(r["input_ids"], r["loss_mask"]) for r in rows] and len(set(stored)) == 3
    result = token_digest_result(path)
    assert result.passed and result.description == "all 3 rows match the digest written with them"


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
    assert result.description == ("1 of 3 rows hold ids or a loss mask other than token_ids wrote "
                                  "(their row_digest differs): facts/s1")
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


def test_a_table_without_digests_says_so(target_tokenizer, tmp_path):
    path = tmp_path / "facts.parquet"
    _native_table(target_tokenizer, path)
    pl.read_parquet(path).drop(DIGEST_COLUMN).write_parquet(path)
    result = token_digest_result(path)
    assert not result.passed and result.severity == dg.AssetCheckSeverity.WARN
    assert "has no row_digest column" in result.description and "cannot be detected in its 3 rows" in result.description


def test_the_corpus_keeps_the_digests_and_its_check_names_an_edited_row(target_tokenizer, tmp_path):
    """merged_corpus carries the rows' digests; corpus_integrity recomputes them, so an id edited in
    the corpus (what hidden_states reads) fails too, the row named."""
    from eagle3_assets.corpus.checks import corpus_integrity_result
    from eagle3_assets.corpus.merge import merge_corpus

    tokens = tmp_path / "facts.parquet"
    _native_table(target_tokenizer, tokens)
    corpus, _ = merge_corpus(pl.read_parquet(tokens), eval_fraction=0.0)
    path = tmp_path / "corpus.parquet"
    corpus.write_parquet(path)
    with duckdb.connect() as con:
        ok = corpus_integrity_result(con, str(path))
    assert ok.passed and ok.description.endswith("every row matching its digest")
    _edit(path, "s0")
    with duckdb.connect() as con:
        bad = corpus_integrity_result(con, str(path))
    assert not bad.passed and bad.description == "1 rows hold ids or a loss mask other than token_ids wrote (facts/s0)"
