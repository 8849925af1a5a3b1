"""Prompt length with the target's chat template, the context check in `prompts`, and the asset's errors.

The target is the embedded SmolLM2 (context 8,192 tokens). The long prompt is the issue's: about
180 KB of text, several times that context. Files are a handful of rows; at real scale the same
pass streams a million rows in chunks of 1,024 (``benchmarks/prompts.py``).
"""

import json
import random

import dagster as dg
import polars as pl
import pytest

from eagle3_assets.prompts.build import build_prompt_table
from eagle3_assets.prompts.context import ContextLimit, rendered_lengths, truncate_last_turn
from eagle3_assets.prompts.reader import PromptReader
from eagle3_assets.prompts.rows import Prompt
from eagle3_assets.prompts.table import read_prompt_table
from tests.conftest import small_prompts, write_jsonl
from tests.support.dagster_helpers import run_dataset

pytestmark = pytest.mark.model

WORDS = ("river stone quantum ledger violet harbor anchor meadow cipher lantern orbit "
         "granite willow ember falcon prism tundra velvet comet saffron").split()


def long_text(n_bytes: int = 180_000, seed: int = 0) -> str:
    rng = random.Random(seed)
    out, size = [], 0
    while size < n_bytes:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return "Summarize the following notes. " + " ".join(out) + " What is the main theme?"


def long_prompt_rows() -> list[dict]:
    rows = small_prompts(4)
    rows.insert(2, {"id": "huge", "messages": [{"role": "user", "content": long_text()}]})
    return rows


def test_batched_lengths_equal_the_rendered_prompt(target_tokenizer):
    convs = [p["messages"] for p in small_prompts(5)] + [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again <|im_end|> literal"}]]
    assert rendered_lengths(target_tokenizer, convs) == [len(target_tokenizer.render_prompt(c)) for c in convs]


@pytest.mark.parametrize("thinking", [None, False])
def test_batched_lengths_follow_kimis_template_and_thinking_switch(tmp_path_factory, thinking):
    from eagle3_assets.target.tokenizer import TargetTokenizer
    from tests.support.kimi_tokenizer import build_kimi_test_tokenizer

    tok = TargetTokenizer.load(build_kimi_test_tokenizer(tmp_path_factory.mktemp("kimi") / "Kimi-Test"),
                               end_of_turn="<|im_end|>", thinking=thinking, trust_remote_code=True)
    convs = [[{"role": "system", "content": "You are Kimi."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "And now?"}],
             [{"role": "user", "content": "plain"}]]
    assert rendered_lengths(tok, convs) == [len(tok.render_prompt(c)) for c in convs]


def test_a_chat_template_that_refuses_a_row_names_it(target_tokenizer):
    import copy

    tok = copy.copy(target_tokenizer)
    tok.tokenizer = copy.deepcopy(target_tokenizer.tokenizer)
    tok.tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                                   "{{ raise_exception('System role not supported') }}{% endif %}"
                                   "{{ m['content'] }}{% endfor %}")
    out = rendered_lengths(tok, [[{"role": "user", "content": "fine"}],
                                 [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]])
    assert isinstance(out[0], int)
    assert out[1].startswith("the target's chat template refuses it: System role not supported")


def test_truncation_keeps_head_and_tail_and_fits(target_tokenizer):
    text = long_text()
    p = Prompt("huge", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}], 3)
    p.prompt_tokens = len(target_tokenizer.render_prompt(p.messages))
    assert p.prompt_tokens > 8192 * 3  # the prompt: several contexts long
    fitted = truncate_last_turn(target_tokenizer, p, 8192 - 256)
    assert fitted.truncated and fitted.prompt_tokens <= 8192 - 256
    assert fitted.prompt_tokens == len(target_tokenizer.render_prompt(fitted.messages))
    assert fitted.prompt_tokens > 0.9 * (8192 - 256)  # cut to fit, not to nothing
    content = fitted.messages[-1]["content"]
    assert content.startswith("Summarize the following notes.") and content.endswith("What is the main theme?")
    assert fitted.messages[0] == p.messages[0]
    assert truncate_last_turn(target_tokenizer, p, 5) is None  # the rest alone does not fit


def test_one_pass_reports_format_and_context_problems_together(tmp_path, target_tokenizer):
    rows = long_prompt_rows() + ['{"oops"', {"id": "huge2", "messages": [{"role": "user", "content": long_text(seed=1)}]}]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    out = tmp_path / "table.parquet"
    reader = PromptReader(path)
    with pytest.raises(Exception) as e:
        build_prompt_table(reader, target_tokenizer, ContextLimit(8192, 256), "refuse", out, chunk_rows=2)
    text = str(e.value)
    assert "3 of 7 rows cannot be used" in text
    assert "2  too long for the target's context" in text and "1  not valid JSON" in text
    assert "line 3, field '(prompt)': renders to" in text and "over the target's context of 8,192" in text
    assert not out.exists() and not list(tmp_path.glob(".table.parquet.tmp-*"))


def _prompts_run(instance, name, **config):
    return run_dataset(instance, name, selection=["prompts"], run_config={"ops": {"prompts": {"config": config}}})


def _step_failure_message(result) -> str:
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    data = failure.event_specific_data
    assert data.user_failure_data is not None  # a dg.Failure: the summary is the message, not a traceback's cause
    return data.user_failure_data.description


def test_prompts_asset_refuses_a_prompt_over_the_context_and_keeps_the_old_table(layout, target_tokenizer):
    write_jsonl(layout.prompt_source("ctx"), small_prompts(3))
    with dg.instance_for_test() as instance:
        assert _prompts_run(instance, "ctx").success
        before = layout.prompt_table("ctx").read_bytes()
        write_jsonl(layout.prompt_source("ctx"), long_prompt_rows())
        result = _prompts_run(instance, "ctx")
        assert not result.success
        message = _step_failure_message(result)
        assert message.startswith(f"{layout.prompt_source('ctx')}: 1 of 5 rows cannot be used")
        assert "line 3, field '(prompt)': renders to" in message and "over_context: skip or truncate" in message
        assert layout.prompt_table("ctx").read_bytes() == before


def test_prompts_asset_skips_or_truncates_and_reports_lengths(layout, target_tokenizer):
    write_jsonl(layout.prompt_source("ctx"), long_prompt_rows())
    with dg.instance_for_test() as instance:
        skipped = _prompts_run(instance, "ctx", over_context="skip")
        assert skipped.success
        meta = skipped.asset_materializations_for_node("prompts")[0].metadata
        assert meta["rows"].value == 4 and meta["over_context"].value == 1 and meta["skipped_over_context"].value == 1
        assert meta["context_length"].value == 8192 and meta["context_reserve"].value == 256
        assert meta["prompt_tokens_max"].value > 8192 > meta["prompt_tokens_p50"].value
        table = read_prompt_table(layout.prompt_table("ctx"))
        assert [p.prompt_id for p in table] == ["q0", "q1", "q2", "q3"]
        assert all(p.prompt_tokens == len(target_tokenizer.render_prompt(p.messages)) for p in table)

        truncated = _prompts_run(instance, "ctx", over_context="truncate")
        assert truncated.success
        assert truncated.asset_materializations_for_node("prompts")[0].metadata["truncated"].value == 1
        frame = pl.read_parquet(layout.prompt_table("ctx"))
        huge = frame.filter(pl.col("prompt_id") == "huge").row(0, named=True)
        assert huge["truncated"] and huge["line"] == 3 and huge["prompt_tokens"] <= 8192 - 256
        assert huge["prompt_tokens"] == len(target_tokenizer.render_prompt(json.loads(huge["messages"])))


def test_generation_refuses_replies_longer_than_the_prompts_reserved(layout, target_tokenizer):
    """`prompts` fitted the long prompt with 256 tokens left for the reply; generation asking for
    1,024 would run past the context on it, so it refuses before generating anything."""
    write_jsonl(layout.prompt_source("ctx"), long_prompt_rows())
    with dg.instance_for_test() as instance:
        assert _prompts_run(instance, "ctx", over_context="truncate").success
        result = run_dataset(instance, "ctx", selection=["raw_responses"],
                             run_config={"ops": {"raw_responses": {"config": {"max_new_tokens": 1024}}}})
        assert not result.success
        message = " ".join(_step_failure_message(result).split())
        assert message.startswith("dataset 'ctx': 1 prompt leaves less than max_new_tokens=1,024")
        assert "prompt file line 3, id 'huge'" in message and "context reserve of 1,024" in message
        assert not layout.responses_dir("ctx").exists() or not any(layout.responses_dir("ctx").glob("*.jsonl"))


def test_the_context_reserve_is_a_dataset_setting(layout, target_tokenizer):
    from eagle3_assets.resources import DatasetSettings

    write_jsonl(layout.prompt_source("tight"), small_prompts(2))
    n = len(target_tokenizer.render_prompt(small_prompts(1)[0]["messages"]))
    settings = DatasetSettings(context_reserve={"tight": 8192 - n + 1})  # the shortest prompt no longer fits
    with dg.instance_for_test() as instance:
        result = run_dataset(instance, "tight", selection=["prompts"], run_config={},
                             resources={"dataset_settings": settings})
        assert not result.success
        assert "2 too long for the target's context" in " ".join(_step_failure_message(result).split())


def test_prompts_asset_reads_parquet_with_saved_read_options(layout, target_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle3_assets.prompts.options import ColumnMap, ReadOptions

    path = layout.prompt_file("alpaca", ".parquet")
    path.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([{"instruction": "Add 2 and 3.", "input": "", "output": "5"},
                                         {"instruction": "Spell 'cat' backwards.", "input": None, "output": "tac"}]),
                   path)
    with dg.instance_for_test() as instance:
        result = _prompts_run(instance, "alpaca")
        assert "neither a 'messages'" in _step_failure_message(result)
        ReadOptions(columns=ColumnMap(user=["instruction", "input"])).save(layout.prompt_read_options("alpaca"))
        assert _prompts_run(instance, "alpaca").success
    rows = read_prompt_table(layout.prompt_table("alpaca"))
    assert [p.messages for p in rows] == [[{"role": "user", "content": "Add 2 and 3."}],
                                          [{"role": "user", "content": "Spell 'cat' backwards."}]]
