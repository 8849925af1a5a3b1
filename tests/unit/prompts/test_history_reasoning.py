"""Agent traces as K2.5 sees them: history reasoning kept from every format and rendered the way
K2.5's template renders it, tool results named after their call, the default system turn, and
the backend's refusal of a history tool-call turn without reasoning reported as the rows' problem."""

import pytest

from eagle3_assets.engines.http.classify import MISSING_REASONING, classify
from eagle3_assets.engines.openrouter.backend import openrouter_messages
from eagle3_assets.generation.http_report import HttpGenerationReport
from eagle3_assets.prompts.problems import RowError
from eagle3_assets.prompts.rows import parse_row
from eagle3_assets.target.tokenizer import TargetTokenizer
from tests.support.kimi_tokenizer import build_kimi_test_tokenizer

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
DEFAULT_SYSTEM = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return TargetTokenizer.load(build_kimi_test_tokenizer(tmp_path_factory.mktemp("kimi") / "Kimi-Reasoning"),
                                trust_remote_code=True)


def _openai(reasoning_fields: dict) -> dict:
    return {"messages": [{"role": "user", "content": "Weather in Oslo?"},
                         {"role": "assistant", "content": None, "tool_calls": [CALL], **reasoning_fields},
                         {"role": "tool", "tool_call_id": "call_1", "content": "snow"}]}


@pytest.mark.parametrize("fields", [
    {"reasoning_content": "need the weather"},  # OpenAI-compatible servers, Moonshot
    {"reasoning": "need the weather"},  # OpenRouter
    {"reasoning_details": [{"type": "reasoning.text", "text": "need the "}, {"type": "reasoning.text", "text": "weather"},
                           {"type": "reasoning.encrypted", "data": "opaque"}]},  # OpenRouter's structured form
])
def test_reasoning_is_kept_from_each_openai_style_field(fields):
    p = parse_row(_openai(fields), 1)
    assert p.messages[1]["reasoning_content"] == "need the weather"
    assert p.messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "snow", "name": "get_weather"}


def test_sharegpt_thought_field_and_bad_reasoning():
    row = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello", "thought": "greet"},
                             {"from": "human", "value": "Bye"}]}
    assert parse_row(row, 1).messages[1] == {"role": "assistant", "content": "Hello", "reasoning_content": "greet"}
    with pytest.raises(RowError) as e:
        parse_row(_openai({"reasoning_content": 5}), 3)
    assert e.value.field == "messages[1].reasoning_content"


SHAREGPT_CALL = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'


@pytest.mark.parametrize("turns,want", [
    ([{"from": "function_call", "value": SHAREGPT_CALL, "thought": "need the weather"}], "need the weather"),
    # joined to the text turn before it: that turn's reasoning, then the call turn's
    ([{"from": "gpt", "value": "Let me look.", "thought": "a tool knows"},
      {"from": "function_call", "value": SHAREGPT_CALL, "thought": "need the weather"}], "a tool knows\n\nneed the weather"),
    ([{"from": "gpt", "value": "Let me look."}, {"from": "function_call", "value": SHAREGPT_CALL, "thinking": "need it"}],
     "need it"),
])
def test_sharegpt_thought_on_a_function_call_turn_is_the_turns_reasoning(tmp_path, kimi, turns, want):
    """Through the prompt table into the request and the rendering: nothing said is dropped."""
    from eagle3_assets.prompts.build import build_prompt_table
    from eagle3_assets.prompts.context import ContextLimit
    from eagle3_assets.prompts.options import ReadOptions
    from eagle3_assets.prompts.reader import PromptReader
    from eagle3_assets.prompts.table import read_prompt_table
    from tests.conftest import write_jsonl

    row = {"id": "c1", "conversations": [{"from": "human", "value": "Weather in Oslo?"}, *turns,
                                         {"from": "observation", "value": '{"sky": "snow"}'}]}
    reader = PromptReader(write_jsonl(tmp_path / "sg.jsonl", [row]), ReadOptions())
    build_prompt_table(reader, kimi, ContextLimit(4096, 256), "refuse", tmp_path / "t.parquet")
    assert reader.skipped == 0
    (p,) = read_prompt_table(tmp_path / "t.parquet")
    call_turn = p.messages[1]
    assert call_turn["tool_calls"][0]["function"]["name"] == "get_weather" and call_turn["reasoning_content"] == want
    assert openrouter_messages(p.messages)[1]["reasoning"] == want  # the request carries it
    text = kimi.decode(kimi.render_prompt(p.messages, p.tools))
    assert f"<think>{want}</think>" in text  # the current loop's reasoning, rendered


@pytest.mark.parametrize("turn", [{"from": "human", "value": "Hi", "thought": "mine"},
                                  {"role": "tool", "content": "snow", "reasoning": "why"}])
def test_reasoning_that_cannot_be_placed_is_a_counted_problem(tmp_path, turn):
    """Reasoning on a turn that is not the assistant's has nowhere to go: the row is a counted, named
    bad row (kind 'reasoning that cannot be placed'), never silently stripped."""
    from eagle3_assets.prompts.reader import PromptReader
    from tests.conftest import write_jsonl

    if "from" in turn:
        row = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}, turn]}
    else:
        row = {"messages": [*_openai({})["messages"][:2], {**turn, "tool_call_id": "call_1"}]}
    reader = PromptReader(write_jsonl(tmp_path / "x.jsonl", [row, _openai({})]), skip_invalid=True)
    assert len(list(reader)) == 1 and reader.log.counts == {"reasoning that cannot be placed": 1}
    (problem,) = reader.log.examples
    assert problem.line == 1 and problem.field.endswith((".thought", ".reasoning"))


def test_reasoning_renders_in_the_current_loop_only(kimi):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello", "reasoning_content": "old thought"},
            *parse_row(_openai({"reasoning": "need the weather"}), 1).messages]
    text = kimi.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert "<|im_assistant|>assistant<|im_middle|><think></think>Hello<|im_end|>" in text  # history: empty think
    assert "old thought" not in text and DEFAULT_SYSTEM not in text
    assert "<think>need the weather</think><|tool_calls_section_begin|>" in text  # current loop: its reasoning
    assert "<|im_system|>get_weather<|im_middle|>## Return of call_1\nsnow<|im_end|>" in text  # named result
    without = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in msgs]
    plain = kimi.tokenizer.apply_chat_template(without, tokenize=False, add_generation_prompt=True)
    assert "<think></think><|tool_calls_section_begin|>" in plain
    assert len(kimi.tokenizer.encode(text)) > len(kimi.tokenizer.encode(plain))


def test_default_system_turn_when_the_conversation_has_none(kimi):
    text = kimi.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                              add_generation_prompt=True)
    assert text.startswith(DEFAULT_SYSTEM + "<|im_user|>user<|im_middle|>Hi<|im_end|>")


def test_openrouter_gets_the_reasoning_in_its_own_field():
    msgs = parse_row(_openai({"reasoning_content": "need the weather"}), 1).messages
    sent = openrouter_messages(msgs)
    assert sent[1]["reasoning"] == "need the weather" and "reasoning_content" not in sent[1]
    assert msgs[1]["reasoning_content"] == "need the weather"  # the prompt itself is left as it was


def test_a_400_naming_missing_reasoning_is_the_prompt_files_problem():
    body = {"error": {"message": "thinking is enabled but reasoning_content is missing in assistant tool call "
                                 "message at index 1", "type": "invalid_request_error"}}
    out = classify(400, body)
    assert (out.kind, out.reason) == ("fail", MISSING_REASONING)
    assert classify(400, {"error": {"message": "bad max_tokens"}}).reason == "http_400"
    in_body = classify(200, {"error": {"code": 400, "message": "reasoning_content is missing"}})
    assert in_body.reason == MISSING_REASONING
    report = HttpGenerationReport(source="openrouter")
    report.prompts_missing_reasoning += ["row-7", "row-3", "row-7"]
    assert "prompt ids: row-3, row-7" in report.summary()["prompt_file_problem"]
