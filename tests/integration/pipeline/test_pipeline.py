"""The graph from a prompt file to a merged corpus, with the real embedded model."""

import dagster as dg
import duckdb
import polars as pl
import pytest

from eagle3_assets.generation.response_store import ResponseStore
from tests.conftest import small_prompts, write_jsonl
from tests.support.dagster_helpers import checks_by_name, materialized, run_dataset, small_run_config, wrong_end_of_turn_target

pytestmark = pytest.mark.model


def test_one_partition_end_to_end_then_resume_generates_nothing(layout, model_dir):
    write_jsonl(layout.prompt_source("tiny"), small_prompts(5))
    with dg.instance_for_test() as instance:
        result = run_dataset(instance, "tiny")
        assert result.success
        for asset in ("prompts", "raw_responses", "token_ids", "inventory", "merged_corpus"):
            assert materialized(result, asset), asset
        checks = checks_by_name(result)
        for name in ("special_tokens_valid", "reconstruction_consistency", "token_budget", "corpus_integrity"):
            assert checks[name].passed, (name, checks[name].description)
        assert checks["reconstruction_consistency"].metadata["token_agreement"].value > 0.9

        rows = ResponseStore(layout.responses_dir("tiny")).rows()
        assert len(rows) == 5 and len({r["sample_id"] for r in rows}) == 5
        r = rows[0]
        assert r["source"] == "local" and r["model"] == "SmolLM2-135M-Instruct"
        assert r["completion_tokens"] == len(r["output_ids"]) <= 16
        assert r["finish_reason"] in ("stop", "length")
        if r["finish_reason"] == "stop":
            assert r["output_ids"][-1] == 2  # <|im_end|> kept, as SGLang returns it

        tokens = pl.read_parquet(layout.tokens("tiny"))
        assert tokens.height == 5 and tokens["native_ids"].all()
        assert (tokens["input_ids"].list.len() == tokens["loss_mask"].list.len()).all()
        corpus = pl.read_parquet(layout.corpus("tiny"))
        assert corpus.height == 5 and set(corpus["split"]) <= {"train", "eval"}

        con = duckdb.connect(str(layout.metadata_db), read_only=True)
        total = con.execute("SELECT responses, completion_tokens FROM inventory WHERE dataset='tiny' AND source='all'").fetchone()
        con.close()
        assert total == (5, sum(r["completion_tokens"] for r in rows))

        again = run_dataset(instance, "tiny")
        assert again.success
        meta = again.asset_materializations_for_node("raw_responses")[0].metadata
        assert meta["new_responses"].value == 0 and meta["total_responses"].value == 5


def test_budget_is_never_exceeded(layout, model_dir):
    write_jsonl(layout.prompt_source("capped"), small_prompts(6))
    from eagle3_assets.resources import DatasetSettings

    with dg.instance_for_test() as instance:
        result = run_dataset(instance, "capped", resources={"dataset_settings": DatasetSettings(default_budget_tokens=30)},
                             run_config=small_run_config(max_new_tokens=12))
        assert result.success
        rows = ResponseStore(layout.responses_dir("capped")).rows()
        assert sum(r["completion_tokens"] for r in rows) <= 30
        assert len(rows) == 2  # two reservations of 12 fit in 30, a third does not
        meta = result.asset_materializations_for_node("raw_responses")[0].metadata
        assert meta["left_by_budget"].value == 4
        assert checks_by_name(result)["token_budget"].passed


def test_failing_blocking_check_stops_downstream_in_the_same_run(layout, model_dir):
    write_jsonl(layout.prompt_source("gated"), small_prompts(3))
    with dg.instance_for_test() as instance:
        result = run_dataset(instance, "gated", resources={"target": wrong_end_of_turn_target()})
        stopped = [r for r in ResponseStore(layout.responses_dir("gated")).rows() if r["finish_reason"] == "stop"]
        assert stopped, "the prompts are meant to produce answers that end on a stop token"
        assert not result.success
        check = checks_by_name(result)["special_tokens_valid"]
        assert not check.passed
        # both ids and both strings are named
        assert "'<|endoftext|>', which is id 0" in check.description and "2 ('<|im_end|>')" in check.description
        assert materialized(result, "token_ids")
        assert not materialized(result, "inventory") and not materialized(result, "merged_corpus")
        assert not layout.corpus("gated").exists()


def test_bad_prompt_file_fails_with_file_and_line_or_skips_when_configured(layout):
    write_jsonl(layout.prompt_source("broken"), [small_prompts(1)[0], '{"messages": "oops"}', small_prompts(2)[1]])
    with dg.instance_for_test() as instance:
        result = run_dataset(instance, "broken", selection=["prompts"], run_config={})
        assert not result.success
        failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
        error = failure.event_specific_data.error
        message = error.cause.message if error.cause else error.message
        assert "broken.jsonl: 1 of 3 rows cannot be used" in message and "line 2, field 'messages'" in message
        assert error.cls_name == "Failure" and error.cause is None  # the summary itself, no chained traceback cause
        assert not layout.prompt_table("broken").exists()

        ok = run_dataset(instance, "broken", selection=["prompts"],
                         run_config={"ops": {"prompts": {"config": {"skip_invalid_rows": True}}}})
        assert ok.success
        meta = ok.asset_materializations_for_node("prompts")[0].metadata
        assert meta["rows"].value == 2 and meta["skipped"].value == 1
