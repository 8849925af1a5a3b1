"""Kimi-K2.5's tools as the kimi-mini tokenizer renders them, and tool-call replies as token ids.

The stand-in's ``apply_chat_template`` override does what K2.5's does: defaults ``tokenize=False``
and ``add_generation_prompt=True``, deep-sorts the tool dicts, writes them as a TypeScript namespace
(``tools_ts_str``) and falls back to compact JSON when a schema cannot be written so. A reply's
calls become ids through that same template, and are read back from native ids.
"""

import json

import pytest

from eagle3_assets.target.kimi_mini.tool_declaration_ts import encode_tools_to_typescript_style
from eagle3_assets.target.tokenizer import TargetTokenizer
from eagle3_assets.tokens.rows import build_token_row
from tests.support.kimi_tokenizer import build_kimi_test_tokenizer

IM_END, THINK_END = 163586, 163607
SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARG_BEGIN, CALL_END = 163595, 163596, 163597, 163598, 163599
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather.\nCall it when asked.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
        "city": {"type": "string", "description": "City name", "maxLength": 40},
        "days": {"type": "integer", "minimum": 1},
        "tags": {"type": "array", "items": {"type": "string", "description": "a tag"}},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}, "additionalProperties": False}}}}}
WEATHER_TS = """# Tools

## functions
namespace functions {
// Current weather.
// Call it when asked.
type get_weather = (_: {
  // City name
  // maxLength: 40
  city: string,
  // minimum: 1
  days?: number,
  tags?: Array<
    // a tag
    string
  >,
  // Default: "c"
  unit?: "c" | "f",
  where?: {
    lat?: number,
    [k: string]: never
  }
}) => any;
}
"""


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return TargetTokenizer.load(build_kimi_test_tokenizer(tmp_path_factory.mktemp("kimi") / "Kimi-Tools"),
                                trust_remote_code=True)


def test_typescript_declaration_of_a_function():
    assert encode_tools_to_typescript_style([WEATHER]) == WEATHER_TS
    refs = {"type": "function", "function": {"name": "route", "parameters": {
        "type": "object", "$defs": {"Pt": {"type": "object", "description": "A point", "properties": {"x": {"type": "number"}}}},
        "properties": {"to": {"$ref": "#/$defs/Pt"}, "via": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}}}
    assert encode_tools_to_typescript_style([refs]) == (
        "# Tools\n\n## functions\nnamespace functions {\n// A point\ninterface Pt {\n  x?: number\n}\n"
        "type route = (_: {\n  to?: Pt,\n  via?: string | null\n}) => any;\n}\n")


def test_override_defaults_sorted_tools_and_json_fallback(kimi):
    msgs = [{"role": "user", "content": "Weather?"}]
    text = kimi.tokenizer.apply_chat_template(msgs, tools=[WEATHER])  # K2.5's defaults: text, generation prompt
    assert text == ("<|im_system|>tool_declare<|im_middle|>" + WEATHER_TS + "<|im_end|>"
                    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
                    "<|im_user|>user<|im_middle|>Weather?<|im_end|><|im_assistant|>assistant<|im_middle|><think>")
    # a schema the encoder cannot write: the template's compact JSON, keys deep-sorted by the override
    odd = {"type": "function", "function": {"parameters": {"properties": {"x": {"description": "no type"}},
                                                           "type": "object"}, "name": "odd"}}
    text = kimi.tokenizer.apply_chat_template(msgs, tools=[odd])
    assert text.startswith('<|im_system|>tool_declare<|im_middle|>[{"function":{"name":"odd","parameters":'
                           '{"properties":{"x":{"description":"no type"}},"type":"object"}},"type":"function"}]<|im_end|>')


def test_history_calls_and_results_render_as_kimi_does(kimi):
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "functions.get_weather:0", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}]
    text = kimi.tokenizer.apply_chat_template(msgs, tools=[WEATHER])
    assert text.endswith(
        "<|im_assistant|>assistant<|im_middle|><think></think><|tool_calls_section_begin|><|tool_call_begin|>"
        'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
        "<|im_end|><|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>")


def row(**kw):
    base = {"sample_id": "s", "dataset": "d", "prompt_id": "p", "source": "openrouter", "prompt_ids": None,
            "output_ids": None, "text": None, "reasoning": None, "tool_calls": None, "finish_reason": "stop"}
    return {**base, **kw}


CALLS = [{"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
         {"id": "functions.get_weather:2", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]
HISTORY = [{"role": "user", "content": "Hi"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
           {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
           {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And in Paris and Rome?"}]


def test_text_row_with_calls_is_the_templates_rendering_of_the_reply(kimi):
    t = build_token_row(row(text="Checking.", reasoning="Two cities.", tool_calls=CALLS), HISTORY, kimi, tools=[WEATHER])
    completion = t["input_ids"][t["prompt_len"]:]
    assert t["built_from"] == "retokenized" and t["tool_calls"] == 2 and t["has_tools"]
    assert "tool-call ids rebuilt as functions.<name>:<index>" in t["build_notes"]
    # the reply's calls are the conversation's second and third (indexes 1 and 2), whatever ids they came with
    assert kimi.decode(completion) == (
        "Two cities.</think>Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:1"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_weather:2'
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|><|im_end|>")
    assert t["loss_mask"] == [0] * t["prompt_len"] + [1] * len(completion)
    # and prompt + completion is the template's own rendering of the conversation with that reply
    reply = {"role": "assistant", "content": "Checking.", "reasoning_content": "Two cities.",
             "tool_calls": [{**CALLS[0], "id": "functions.get_weather:1"}, CALLS[1]]}
    full = kimi.tokenizer.apply_chat_template([*HISTORY, reply], tools=[WEATHER], tokenize=True,
                                              add_generation_prompt=False, return_dict=True)["input_ids"]
    assert t["input_ids"] == list(full)
    cut = build_token_row(row(tool_calls=CALLS, finish_reason="length"), HISTORY, kimi, tools=[WEATHER])
    assert cut["input_ids"][-1] == SECTION_END  # a reply cut short never closed its turn


PROVIDER_IDS = {  # a provider's id for a turn's k-th call: its index restarts each turn
    "functions.NAME:i": lambda name, k: f"functions.{name}:{k}",
    "NAME:i": lambda name, k: f"{name}:{k}",
    "call_...": lambda name, k: f"call_{name[:3]}{k}x9",
}


@pytest.mark.parametrize("form", sorted(PROVIDER_IDS))
def test_reply_call_ids_count_the_conversations_calls_for_every_provider_form(kimi, form):
    """K2.5 numbers a call by the conversation's call count, history and reply alike: after two
    history calls a reply's two calls are ``:2`` and ``:3`` whatever the provider wrote. The ids are
    read back out of the rendered training sequence, not from the calls the code built."""
    import re

    make = PROVIDER_IDS[form]
    history = [{"role": "user", "content": "Oslo and Rome?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": f"functions.get_weather:{k}", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"}} for k in range(2)]},
               {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
               {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "rain"},
               {"role": "user", "content": "And Lima, Quito?"}]
    calls = [{"id": make("get_weather", k), "type": "function",
              "function": {"name": "get_weather", "arguments": "{}"}} for k in range(2)]
    t = build_token_row(row(text="", tool_calls=calls), history, kimi, tools=[WEATHER])
    text = kimi.decode(t["input_ids"])
    ids = re.findall(r"<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>", text)
    assert ids == [f"functions.get_weather:{k}" for k in range(4)], ids
    assert len(set(ids)) == len(ids)


def test_native_row_calibrates_against_the_rerendered_calls(kimi):
    prompt = kimi.render_prompt(HISTORY, [WEATHER])
    enc = kimi.encode_text
    native = (enc("Two cities.") + [THINK_END, SECTION_BEGIN, CALL_BEGIN] + enc("functions.get_weather:1")
              + [ARG_BEGIN] + enc('{"city": "') + enc("Par") + enc("is") + enc('"}') + [CALL_END, SECTION_END, IM_END])
    r = row(source="sglang", prompt_ids=prompt, output_ids=native, text=kimi.decode(native[:-1]))
    t = build_token_row(r, HISTORY, kimi, tools=[WEATHER])
    assert t["native_ids"] and t["input_ids"][t["prompt_len"]:] == native  # the model's ids are the sequence
    assert t["tool_calls"] == 1 and "tool calls read from the ids" in t["build_notes"]
    assert not t["retok_exact"] and t["retok_total"] - t["retok_matched"] == 2  # "Par"+"is" vs "Paris"
    assert kimi.parse_tool_calls(native) == [{"id": "functions.get_weather:1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert kimi.parse_tool_calls(native[:-3] + [IM_END]) is None  # an unclosed section is no call
    exact = (enc("Two cities.") + [THINK_END, SECTION_BEGIN, CALL_BEGIN] + enc("functions.get_weather:1") + [ARG_BEGIN]
             + enc('{"city": "Paris"}') + [CALL_END, SECTION_END, IM_END])
    assert build_token_row({**r, "output_ids": exact}, HISTORY, kimi, tools=[WEATHER])["retok_exact"]


def test_a_vllm_row_uses_the_servers_parsed_calls(kimi):
    prompt = kimi.render_prompt(HISTORY, [WEATHER])
    native = (kimi.encode_text("ok") + [THINK_END, SECTION_BEGIN, CALL_BEGIN] + kimi.encode_text("functions.get_weather:1")
              + [ARG_BEGIN] + kimi.encode_text('{"city":"Paris"}') + [CALL_END, SECTION_END, IM_END])
    parsed = [{"id": "functions.get_weather:1", "type": "function",
               "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]  # the parser's spacing
    t = build_token_row(row(source="vllm", prompt_ids=prompt, output_ids=native, text=None, tool_calls=parsed),
                        HISTORY, kimi, tools=[WEATHER])
    assert "tool calls from the server's parser" in t["build_notes"] and not t["retok_exact"]
