"""A prompt per assistant turn: every reply of a conversation becomes a prompt (the prefix before
it), so the target makes its own call at every call point and its own answer after every result."""

import json

import dagster as dg
import polars as pl
import pytest

from eagle3_assets.corpus.merge import eval_side, merge_corpus
from eagle3_assets.generation.response_store import ResponseStore
from eagle3_assets.loopback import ModelGenerator, SGLangApp, serve_in_thread
from eagle3_assets.prompts.options import ReadOptions
from eagle3_assets.prompts.reader import PromptReader
from eagle3_assets.prompts.table import read_conversations, read_prompt_table, write_prompt_table
from eagle3_assets.prompts.turns import conversation_id, prompts_per_conversation_rows
from eagle3_assets.resources import SGLangResource, TargetResource
from tests.conftest import write_jsonl
from tests.support.dagster_helpers import run_dataset, small_run_config

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
SYSTEM = ("SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -\n"
          + json.dumps(WEATHER, indent=4))
CALL = "ASSISTANT: <functioncall> {\"name\": \"get_weather\", \"arguments\": '{\"city\": \"Lima\"}'} <|endoftext|>"
GLAIVE = [  # 3 replies (call, answer, answer); a plain question; a reply to nothing (refused)
    {"system": SYSTEM, "chat": f"USER: Weather in Lima?\n\n\n{CALL}\n\n\nFUNCTION RESPONSE: {{\"sky\": \"fog\"}}\n\n\n"
                               "ASSISTANT: Foggy. <|endoftext|>\n\n\nUSER: Thanks!\n\n\n"
                               "ASSISTANT: You're welcome. <|endoftext|>"},
    {"system": SYSTEM, "chat": "USER: Weather in Oslo?"},
]
PARALLEL = {"id": "trace", "tools": [{"type": "function", "function": WEATHER}], "messages": [
    {"role": "user", "content": "Oslo and Lima?"},
    {"role": "assistant", "content": None, "reasoning_content": "two cities, two calls", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}}]},
    {"role": "tool", "tool_call_id": "call_b", "content": "sun"}, {"role": "tool", "tool_call_id": "call_a", "content": "snow"},
    {"role": "assistant", "content": "Snow in Oslo, sun in Lima."}]}


def test_each_assistant_turn_becomes_a_prompt(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", [*GLAIVE, {"messages": [{"role": "assistant", "content": "hi"}]}])
    reader = PromptReader(path, ReadOptions(prompt_per_assistant_turn=True), skip_invalid=True)
    prompts = list(reader)
    reader.finish()
    first = [p for p in prompts if p.line == 1]
    assert [p.messages[-1]["role"] for p in first] == ["user", "tool", "user"]
    assert [len(p.messages) for p in first] == [2, 4, 6]  # system + the prefix before each reply
    assert first[1].messages[-2]["tool_calls"][0]["function"]["name"] == "get_weather"
    ids = [p.prompt_id for p in prompts]
    assert len(set(ids)) == 4 and all(i.endswith(f"@turn{k}") for k, i in enumerate(ids[:3]))
    assert {conversation_id(i) for i in ids[:3]} == {ids[0][:-len("@turn0")]}
    assert (reader.conversations, reader.accepted, reader.skipped) == (2, 4, 1)
    assert prompts_per_conversation_rows(reader.prompts_per_conversation) == [
        {"prompts": 1, "conversations": 1}, {"prompts": 3, "conversations": 1}]
    assert all(p.conversation is None for p in prompts)
    whole = list(PromptReader(path, ReadOptions(final_assistant="drop"), skip_invalid=True))
    assert len(whole) == 2 and whole[0].messages == first[2].messages  # the last prefix: the old single prompt


def test_the_split_keeps_a_conversation_on_one_side():
    for n in range(200):
        conv = f"conv-{n}"
        sides = {eval_side(f"{conv}@turn{k}", 0.3) for k in range(5)}
        assert sides == {eval_side(conv, 0.3)}
    assert conversation_id("a@turn2@turn10") == "a@turn2" and conversation_id("plain") == "plain"


def test_a_files_own_turn_like_id_is_its_own_conversation(tmp_path):
    """A file's ids ``conv@turn3`` and ``conv`` read one prompt each are two conversations; the same
    conversation read per assistant turn is one. The table's ``conversation_id`` says which, so the
    split never reads ids apart; a table written before that column splits as it did then."""
    rows = [{"id": "conv", "messages": [{"role": "user", "content": "a"}]},
            {"id": "conv@turn3", "messages": [{"role": "user", "content": "b"}]}]
    path = write_jsonl(tmp_path / "ids.jsonl", rows)
    table = tmp_path / "t.parquet"
    write_prompt_table(list(PromptReader(path, ReadOptions())), table)
    assert read_conversations(table) == {"conv": "conv", "conv@turn3": "conv@turn3"}
    turns = write_jsonl(tmp_path / "turns.jsonl", [{**GLAIVE[0], "id": "conv@turn3"}])
    per_turn = tmp_path / "per_turn.parquet"
    write_prompt_table(list(PromptReader(turns, ReadOptions(prompt_per_assistant_turn=True))), per_turn)
    assert read_conversations(per_turn) == {f"conv@turn3@turn{k}": "conv@turn3" for k in range(3)}
    assert {p.conversation_id for p in read_prompt_table(per_turn)} == {"conv@turn3"}

    # find a pair the old reading put on one side and the table puts on two
    for n in range(400):
        a, b = f"c{n}", f"c{n}@turn3"
        if eval_side(a, 0.5, a) != eval_side(b, 0.5, b):
            break
    assert eval_side(b, 0.5) == eval_side(a, 0.5)  # the old reading: one conversation
    tokens = pl.DataFrame({"sample_id": [f"{a}#0", f"{b}#0"], "prompt_id": [a, b], "sample_index": [0, 0],
                           "source": ["local", "local"], "native_ids": [True, True], "finish_reason": ["stop", "stop"],
                           "completion_len": [3, 3], "text_len": [5, 5]})
    split = dict(merge_corpus(tokens, 0.5, {a: a, b: b})[0].select("prompt_id", "split").iter_rows())
    assert split[a] != split[b]
    legacy = dict(merge_corpus(tokens, 0.5, None)[0].select("prompt_id", "split").iter_rows())
    assert legacy[a] == legacy[b]  # a table without the column: the split as before


@pytest.mark.model
def test_turn_prompts_through_generation(layout, kimi_mini_dir):
    from eagle3_assets.target.embedded import EmbeddedModel
    from eagle3_assets.target.tokenizer import TargetTokenizer

    dataset = "glaive_turns"
    write_jsonl(layout.prompt_source(dataset), [*GLAIVE, PARALLEL])
    ReadOptions(prompt_per_assistant_turn=True).save(layout.prompt_read_options(dataset))
    model = EmbeddedModel(kimi_mini_dir, tokenizer=TargetTokenizer.load(kimi_mini_dir, trust_remote_code=True))
    with serve_in_thread(SGLangApp(ModelGenerator(model))) as sgl, dg.instance_for_test() as instance:
        res = {"target": TargetResource(model="kimi-mini"), "sglang": SGLangResource(base_urls=[sgl.url])}
        result = run_dataset(instance, dataset, resources=res, selection=["prompts", "raw_responses", "token_ids"],
                             run_config=small_run_config(backend="sglang", max_new_tokens=8))
        assert result.success
        again = run_dataset(instance, dataset, resources=res, selection=["raw_responses"],
                            run_config=small_run_config(backend="sglang", max_new_tokens=8))
        assert again.success
    meta = result.asset_materializations_for_node("prompts")[0].metadata
    assert (meta["rows"].value, meta["conversations"].value, meta["prompts_per_conversation_mean"].value) == (6, 3, 2.0)
    table = {p.prompt_id: p for p in read_prompt_table(layout.prompt_table(dataset))}
    responses = ResponseStore(layout.responses_dir(dataset)).rows()
    assert len(responses) == 6 and {r["prompt_id"] for r in responses} == set(table)  # resume: nothing twice
    assert len({r["sample_id"] for r in responses}) == 6
    # the parallel calls' answer: both calls in one section, its reasoning, each result named
    after = table["trace@turn1"]
    text = model.target_tokenizer.decode(model.target_tokenizer.render_prompt(after.messages, tools=after.tools))
    assert "<think>two cities, two calls</think><|tool_calls_section_begin|>" in text
    assert text.count("<|tool_call_begin|>") == 2 and text.count("<|im_system|>get_weather<|im_middle|>") == 2
    tokens = pl.read_parquet(layout.tokens(dataset))
    assert tokens.height == 6 and set(tokens["prompt_id"]) == set(table)
