"""Agentic prompt files: tools, tool calls and tool results in every format users have them in.

glaive-function-calling-v2 (``system`` + ``chat`` text), ShareGPT (LLaMA-Factory's
``function_call``/``observation`` turns with a ``tools`` column, glaive-derived
``function-call``/``function-response`` turns with a ``function_description`` column) and OpenAI
(``tools``, ``tool_calls``, ``tool`` turns) all end in OpenAI's shape; broken calls join the
one-pass summary; the prompt table keeps everything structured.
"""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_assets.prompts.build import build_prompt_table
from eagle3_assets.prompts.context import ContextLimit
from eagle3_assets.prompts.options import ColumnMap, ReadOptions, parse_column_map
from eagle3_assets.prompts.problems import PromptFileError
from eagle3_assets.prompts.reader import PromptReader, read_prompt_file
from eagle3_assets.prompts.table import read_prompt_table
from tests.conftest import write_jsonl

WEATHER = {"name": "get_weather", "description": "Current weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
GLAIVE_SYSTEM = ("SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -\n"
                 + json.dumps(WEATHER, indent=4) + "\n\n" + json.dumps({"name": "get_time", "parameters": {}}, indent=4))
GLAIVE_CHAT = ("USER: Weather in Paris?\n\n\nASSISTANT: <functioncall> {\"name\": \"get_weather\", "
               "\"arguments\": '{\"city\": \"Paris\"}'} <|endoftext|>\n\n\nFUNCTION RESPONSE: {\"sky\": \"clear\"}\n\n\n"
               "ASSISTANT: It is clear in Paris. <|endoftext|>\n\n\nUSER: And the time?")
GLAIVE_PLAIN = {"system": "SYSTEM: You are a helpful assistant, with no access to external functions.",
                "chat": "USER: Tell me a joke.\n\n\nASSISTANT: Why did the chicken cross the road? <|endoftext|>"}


def test_glaive_rows_are_detected_and_read(tmp_path):
    path = write_jsonl(tmp_path / "glaive.jsonl", [{"system": GLAIVE_SYSTEM, "chat": GLAIVE_CHAT}, GLAIVE_PLAIN])
    calls, plain = read_prompt_file(path, options=ReadOptions(final_assistant="drop")).prompts
    assert [t["function"]["name"] for t in calls.tools] == ["get_weather", "get_time"]
    assert calls.tools[0] == {"type": "function", "function": WEATHER}
    assert calls.messages == [
        {"role": "system", "content": "You are a helpful assistant with access to the following functions. "
                                      "Use them if required"},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                                                             "function": {"name": "get_weather",
                                                                          "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": '{"sky": "clear"}',
         "name": "get_weather"},  # named after the call it answers
        {"role": "assistant", "content": "It is clear in Paris."},
        {"role": "user", "content": "And the time?"}]
    assert plain.tools is None and plain.messages == [
        {"role": "system", "content": "You are a helpful assistant, with no access to external functions."},
        {"role": "user", "content": "Tell me a joke."}]  # the final reply dropped, to be regenerated


def test_glaive_declared_by_column_map_in_parquet(tmp_path):
    path = tmp_path / "glaive.parquet"
    pq.write_table(pa.Table.from_pylist([{"sys": GLAIVE_SYSTEM, "dialog": GLAIVE_CHAT, "n": 1}]), path)
    cols = parse_column_map(["chat=dialog", "system=sys", "id=n"])
    assert cols == ColumnMap(chat="dialog", system="sys", id="n")
    (p,) = read_prompt_file(path, options=ReadOptions(columns=cols)).prompts
    assert p.prompt_id == "1" and len(p.tools) == 2 and p.messages[2]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_sharegpt_tool_turns_and_tools_columns(tmp_path):
    path = write_jsonl(tmp_path / "sharegpt.jsonl", [
        {"id": "lf", "tools": json.dumps([WEATHER]), "conversations": [  # LLaMA-Factory's tool format
            {"from": "human", "value": "Weather in Oslo?"},
            {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})},
            {"from": "observation", "value": "snow"},
            {"from": "gpt", "value": "It snows."}, {"from": "human", "value": "Thanks, and Rome?"}]},
        {"id": "chatml", "function_description": GLAIVE_SYSTEM.split("-\n", 1)[1], "conversations": [
            {"from": "human", "value": "Weather in Rome?"},
            {"from": "gpt", "value": "Let me check."},  # a text turn, then its call: one assistant message
            {"from": "function-call", "value": "{\"name\": \"get_weather\", \"arguments\": '{\"city\": \"Rome\"}'}"},
            {"from": "function-response", "value": "{\"sky\": \"rain\"}"}]},
    ])
    lf = read_prompt_file(path, options=ReadOptions(columns=ColumnMap(tools="tools"))).prompts[0]
    assert lf.tools == [{"type": "function", "function": WEATHER}]
    assert lf.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    assert lf.messages[2] == {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "snow",
                              "name": "get_weather"}
    chatml = read_prompt_file(path, options=ReadOptions(columns=ColumnMap(tools="function_description"))).prompts[1]
    assert [t["function"]["name"] for t in chatml.tools] == ["get_weather", "get_time"]
    assert chatml.messages[1]["content"] == "Let me check."
    assert chatml.messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'
    assert chatml.messages[-1]["role"] == "tool"  # a prompt may end with a tool result: the target answers it


def test_openai_tool_rows_keep_their_structure(tmp_path):
    tools = [{"type": "function", "function": WEATHER}, {"type": "function", "function": {"name": "get_time"}}]
    path = write_jsonl(tmp_path / "openai.jsonl", [
        {"id": "a", "tools": tools, "messages": [
            {"role": "user", "content": "Weather in Paris and the time?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
                {"type": "function", "function": {"name": "get_time", "arguments": {}}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "tool", "content": {"time": "noon"}}]},  # no id: answers the call still open
        {"id": "legacy", "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "function_call": {"name": "get_time", "arguments": "{}"}},
            {"role": "function", "name": "get_time", "content": "noon"}]},
    ])
    a, legacy = read_prompt_file(path).prompts
    assert a.tools == [{"type": "function", "function": WEATHER}, {"type": "function", "function": {"name": "get_time"}}]
    assert [c["id"] for c in a.messages[1]["tool_calls"]] == ["call_1", "functions.get_time:1"]
    assert a.messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city":"Paris"}'  # the model's text, kept
    assert a.messages[1]["tool_calls"][1]["function"]["arguments"] == "{}"
    assert a.messages[3] == {"role": "tool", "tool_call_id": "functions.get_time:1", "content": '{"time": "noon"}',
                             "name": "get_time"}
    assert a.messages[2]["name"] == "get_weather"  # each result named after the call it answers (call_1)
    assert legacy.messages[2] == {"role": "tool", "tool_call_id": "functions.get_time:0", "content": "noon",
                                  "name": "get_time"}


def broken_rows() -> list[dict]:
    user = {"role": "user", "content": "x"}
    return [
        {"id": "ok", "tools": [{"type": "function", "function": WEATHER}], "messages": [user]},
        {"id": "args", "messages": [user, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{'city': 'Paris'}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "r"}]},
        {"id": "orphan", "messages": [user, {"role": "tool", "tool_call_id": "call_9", "content": "r"}]},
        {"id": "orphan2", "conversations": [{"from": "human", "value": "x"}, {"from": "observation", "value": "r"}]},
        {"id": "noname", "messages": [user, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"arguments": "{}"}}]}, user]},
        {"id": "retrieval", "tools": [{"type": "retrieval"}], "messages": [user]},
        {"id": "noparams", "tools": [{"name": "f", "parameters": "[1, 2]"}], "messages": [user]},
        {"id": "tooltext", "tools": "get_weather(city)", "messages": [user]},
    ]


def test_broken_calls_in_the_one_pass_summary(tmp_path):
    path = write_jsonl(tmp_path / "broken.jsonl", broken_rows())
    with pytest.raises(PromptFileError) as e:
        read_prompt_file(path)
    assert e.value.counts == {"tool call arguments are not JSON": 1, "tool result answering no call": 2,
                              "tool call without a function name": 1, "tool is not a function definition": 3}
    text = str(e.value)
    assert text.startswith(f"{path}: 7 of 8 rows cannot be used")
    assert "line 2, field 'messages[1].tool_calls[0].function.arguments': not valid JSON" in text
    assert "line 3, field 'messages[1].tool_call_id': answers call 'call_9', which no earlier assistant turn made" in text
    assert "line 4, field 'conversations[1].tool_call_id': a tool result with no call before it" in text
    assert "line 5, field 'messages[1].tool_calls[0].function.name'" in text
    assert "line 6, field 'tools[0]': only {\"type\": \"function\"" in text
    assert "line 7, field 'tools[0].parameters': must be a JSON schema object, got list" in text
    assert "line 8, field 'tools': not valid JSON" in text
    skipped = read_prompt_file(path, skip_invalid=True)
    assert [p.prompt_id for p in skipped.prompts] == ["ok"] and skipped.skipped_count == 7


def test_table_keeps_tools_and_counts_them(tmp_path, target_tokenizer):
    """Through the streaming build into the Parquet table and back; a target without tool support
    (SmolLM2) refuses the tool rows with one reason, or takes the declarations into its system turn."""
    from eagle3_assets.target.tokenizer import TargetTokenizer
    from tests.support.kimi_tokenizer import build_kimi_test_tokenizer

    src = write_jsonl(tmp_path / "mixed.jsonl", [{"system": GLAIVE_SYSTEM, "chat": GLAIVE_CHAT}, GLAIVE_PLAIN])
    options = ReadOptions(final_assistant="drop")
    kimi = TargetTokenizer.load(build_kimi_test_tokenizer(tmp_path / "kimi"), trust_remote_code=True)
    out = tmp_path / "table.parquet"
    report = build_prompt_table(PromptReader(src, options), kimi, ContextLimit(4096, 256), "refuse", out)
    assert report.tool_figures() == {"rows_with_tools": 1, "rows_with_tool_calls": 1, "tool_calls": 1,
                                     "tool_calls_per_row_mean": 0.5, "tool_calls_per_row_max": 1,
                                     "tool_result_turns": 1, "tools_in_system_turn": 0,
                                     "history_call_ids_rebuilt": 0}
    back = read_prompt_table(out)
    assert back[0].tools[0]["function"] == WEATHER and back[0].messages[2]["tool_calls"][0]["id"] == "functions.get_weather:0"
    assert back[0].prompt_tokens == len(kimi.render_prompt(back[0].messages, back[0].tools))
    assert "<|im_system|>tool_declare<|im_middle|># Tools" in kimi.decode(kimi.render_prompt(back[0].messages, back[0].tools))

    assert not target_tokenizer.supports_tools and kimi.supports_tools
    with pytest.raises(PromptFileError) as e:
        build_prompt_table(PromptReader(src, options), target_tokenizer, ContextLimit(8192, 256), "refuse", out)
    assert e.value.counts == {"tools the target's chat template cannot render": 1}
    assert "renders no tools and would drop them; set tools_in_system_turn: true" in str(e.value)
    assert read_prompt_table(out)[0].tools is not None  # the refused file left the previous table as it was
    report = build_prompt_table(PromptReader(src, options), target_tokenizer, ContextLimit(8192, 256), "refuse", out,
                                tools_in_system_turn=True)
    assert report.tools_in_system_turn == 1
    first = read_prompt_table(out)[0]
    assert first.tools is None and first.messages[0]["content"].count('"name": "get_weather"') == 1
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in first.messages[2]["content"]
