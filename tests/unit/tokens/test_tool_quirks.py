"""Tool calls as datasets and providers really write them: Kimi's section read as leniently as
vLLM's kimi_k2 parser (leftovers counted), provider call ids in Kimi's form, glaive's escaped
quotes, text after a call, several calls in one turn; history call ids rebuilt in Kimi's form
with the results that answer them."""

import pytest

from eagle3_assets.prompts.rows import parse_row
from eagle3_assets.target.tokenizer import TargetTokenizer
from eagle3_assets.target.tool_calls import KimiFormat, kimi_call_id, kimi_history_ids
from tests.support.kimi_tokenizer import build_kimi_test_tokenizer

SB, SE, CB, AB, CE = 163595, 163596, 163597, 163598, 163599


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return TargetTokenizer.load(build_kimi_test_tokenizer(tmp_path_factory.mktemp("kimi") / "Kimi-Quirks"),
                                trust_remote_code=True)


def _call(tok, cid: str, args: str) -> list[int]:
    return [CB, *tok.encode_text(cid), AB, *tok.encode_text(args), CE]


def test_section_read_as_leniently_as_vllm(kimi):
    fmt = KimiFormat.of(kimi)
    nl = kimi.encode_text("\n")
    a, b = _call(kimi, "functions.get_weather:0", '{"city": "Oslo"}'), _call(kimi, "functions.get_time:1", "{}")
    strict = kimi.encode_text("ok") + [SB, *a, *b, SE]
    head, calls, left = fmt.split_counted(kimi, strict)
    assert kimi.decode(head) == "ok" and left == 0
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("functions.get_weather:0", "get_weather", '{"city": "Oslo"}'), ("functions.get_time:1", "get_time", "{}")]
    spaced = [SB, *nl, *a, *nl, *b, *nl, SE]  # whitespace between the markers
    assert fmt.split_counted(kimi, spaced)[1] == calls and fmt.split_counted(kimi, spaced)[2] == 0
    assert fmt.split(kimi, [SB, *a, *b])[1] == calls  # no section end
    assert fmt.split(kimi, [SB, *a, *b[:-1], SE])[1] == calls  # the section end closes the last call
    junk = [SB, *kimi.encode_text("noise"), *a, SE]
    _, got, left = fmt.split_counted(kimi, junk)
    assert got == calls[:1] and left >= 1  # stray text: skipped and counted
    bad_id = [SB, *_call(kimi, "weather", "{}"), SE]
    assert fmt.split_counted(kimi, bad_id)[1] is None  # vLLM's id pattern is <name>:<index>
    assert fmt.split(kimi, [SB, *a[:-1]])[1] is None  # cut short inside a call: no call


def test_provider_ids_in_kimis_form():
    """Every provider form gets the count-based id: a provider's own index is not the conversation's."""
    assert kimi_call_id("weather", 5) == "functions.weather:5"
    for cid in ("weather:0", "call_abc", "functions.weather:2", "functions.other:2", None):
        calls, changed = KimiFormat.kimi_ids([{"id": cid, "function": {"name": "weather"}}], 5)
        assert calls[0]["id"] == "functions.weather:5" and changed
    assert KimiFormat.kimi_ids([{"id": "functions.weather:5", "function": {"name": "weather"}}], 5)[1] is False


def _tc(cid, name: str) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": "{}"}}


def test_history_call_ids_in_kimis_form_with_their_results():
    """OpenAI ``call_...`` ids, a provider's bare ``name:idx`` and Kimi's own, parallel calls over
    several agent turns, repeated ids: every call gets ``functions.<name>:<index>`` counting the
    conversation's calls, and each result still answers its own call."""
    msgs = [{"role": "user", "content": "Weather in Oslo and Rome, and the time?"},
            {"role": "assistant", "content": "", "tool_calls": [_tc("call_9xq", "get_weather"), _tc("call_7ab", "get_weather")]},
            {"role": "tool", "tool_call_id": "call_7ab", "name": "get_weather", "content": "sun"},
            {"role": "tool", "tool_call_id": "call_9xq", "name": "get_weather", "content": "snow"},
            {"role": "assistant", "content": "",
             "tool_calls": [_tc("get_time:2", "get_time"), _tc("functions.get_weather:0", "get_weather")]},
            {"role": "tool", "tool_call_id": "get_time:2", "name": "get_time", "content": "10:00"},
            {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather", "content": "rain"}]
    out, changed = kimi_history_ids(msgs)
    assert [c["id"] for c in out[1]["tool_calls"]] == ["functions.get_weather:0", "functions.get_weather:1"]
    # every id counts the conversation's calls, whatever index the file gave
    assert [c["id"] for c in out[4]["tool_calls"]] == ["functions.get_time:2", "functions.get_weather:3"]
    assert [m.get("tool_call_id") for m in out if m["role"] == "tool"] == [
        "functions.get_weather:1", "functions.get_weather:0", "functions.get_time:2", "functions.get_weather:3"]
    assert changed == 4 and msgs[1]["tool_calls"][0]["id"] == "call_9xq"  # the input is left as it was
    assert kimi_history_ids(out) == (out, 0)  # already in Kimi's form: unchanged

    # a provider's index restarting each turn, and one id used for two calls of a turn
    turns = [{"role": "user", "content": "go"},
             {"role": "assistant", "content": "", "tool_calls": [_tc("get_weather:0", "get_weather")]},
             {"role": "tool", "tool_call_id": "get_weather:0", "content": "sun"},
             {"role": "assistant", "content": "", "tool_calls": [_tc("get_time:0", "get_time")]},
             {"role": "tool", "tool_call_id": "get_time:0", "content": "10:00"},
             {"role": "assistant", "content": "", "tool_calls": [_tc("x", "get_weather"), _tc("x", "get_time")]},
             {"role": "tool", "tool_call_id": "x", "content": "rain"}, {"role": "tool", "tool_call_id": "x", "content": "9:00"}]
    out, _ = kimi_history_ids(turns)
    assert [c["id"] for m in out if m.get("tool_calls") for c in m["tool_calls"]] == [
        "functions.get_weather:0", "functions.get_time:1", "functions.get_weather:2", "functions.get_time:3"]
    assert [m["tool_call_id"] for m in out if m["role"] == "tool"] == [
        "functions.get_weather:0", "functions.get_time:1", "functions.get_weather:2", "functions.get_time:3"]
    repeated = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [
        _tc("functions.f:1", "f"), _tc("call_a", "f"), _tc("functions.f:1", "f")]}]
    ids = [c["id"] for c in kimi_history_ids(repeated)[0][1]["tool_calls"]]
    assert ids == ["functions.f:0", "functions.f:1", "functions.f:2"]


def test_history_ids_rebuilt_in_the_prompt_table(tmp_path, kimi):
    """Through the build into the table: the prompt K2.5 sees has its own ids in the history (the
    HTTP request sends the same messages), a SmolLM2-like target keeps the file's ids."""
    from eagle3_assets.prompts.build import build_prompt_table
    from eagle3_assets.prompts.context import ContextLimit
    from eagle3_assets.prompts.options import ReadOptions
    from eagle3_assets.prompts.reader import PromptReader
    from eagle3_assets.prompts.table import read_prompt_table
    from tests.conftest import write_jsonl

    row = {"id": "trace-1", "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [_tc("call_abc", "get_weather")]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "snow"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]}
    src = write_jsonl(tmp_path / "traces.jsonl", [row])
    out = tmp_path / "table.parquet"
    report = build_prompt_table(PromptReader(src, ReadOptions()), kimi, ContextLimit(4096, 256), "refuse", out)
    assert report.tool_figures()["history_call_ids_rebuilt"] == 1
    (back,) = read_prompt_table(out)
    assert back.prompt_id == "trace-1"
    assert back.messages[1]["tool_calls"][0]["id"] == "functions.get_weather:0"
    assert back.messages[2]["tool_call_id"] == "functions.get_weather:0"
    text = kimi.decode(kimi.render_prompt(back.messages, back.tools))
    assert "call_abc" not in text and "## Return of functions.get_weather:0\nsnow" in text


def _glaive(chat: str) -> dict:
    return {"system": 'SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -'
                      ' {"name": "send_note", "parameters": {"type": "object"}} {"name": "get_time"}',
            "chat": chat}


def test_glaive_escaped_quotes_text_after_and_several_calls():
    call = ("ASSISTANT: <functioncall> {\"name\": \"send_note\", \"arguments\": '{\"text\": \"it\\'s {done}\", "
            "\"meta\": {\"tags\": [\"a\", \"b\"]}}'} I have sent it. <|endoftext|>")
    p = parse_row(_glaive(f"USER: Send 'it's done'\n\n\n{call}\n\n\nFUNCTION RESPONSE: {{\"ok\": true}}\n\n\n"
                          "USER: Thanks"), 1)
    turn = p.messages[2]
    assert turn["content"] == "I have sent it."  # text after the call: the turn's content
    assert turn["tool_calls"][0]["function"]["arguments"] == '{"text": "it\'s {done}", "meta": {"tags": ["a", "b"]}}'
    assert p.messages[3]["name"] == "send_note"
    two = ("ASSISTANT: Doing both. <functioncall> {\"name\": \"send_note\", \"arguments\": '{}'} "
           "<functioncall> {\"name\": \"get_time\", \"arguments\": {}} <|endoftext|>")
    q = parse_row(_glaive(f"USER: Note and time\n\n\n{two}\n\n\nFUNCTION RESPONSE: {{\"ok\": true}}\n\n\n"
                          "FUNCTION RESPONSE: {\"time\": \"noon\"}"), 2)
    assert q.messages[2]["content"] == "Doing both."
    assert [c["id"] for c in q.messages[2]["tool_calls"]] == ["functions.send_note:0", "functions.get_time:1"]
    assert [m.get("name") for m in q.messages[3:]] == ["send_note", "get_time"]  # parallel results, in order


@pytest.mark.parametrize("malform", [None, "whitespace", "no_section_end", "stray_in_section", "text_after_section"])
def test_broken_sections_written_by_the_loopback_are_read_back(kimi, malform):
    """The loopback writes a section broken each way servers break it; the parser still reads the
    calls the writer reports, and counts what it leaves outside any call."""
    from eagle3_assets.loopback.tool_replies import ToolCaller

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    prompt_ids = kimi.render_prompt([{"role": "user", "content": "Weather in Oslo?"}], tools)
    reply = ToolCaller(kimi, malform).reply(prompt_ids, kimi.encode_text("Oslo is cold today") + [kimi.end_of_turn_id])
    ids = reply.output_ids
    assert (SE in ids) == (malform != "no_section_end") and ids[-1] == kimi.end_of_turn_id
    head, calls, left = KimiFormat.of(kimi).split_counted(kimi, ids)
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in reply.tool_calls]
    assert (left > 0) == (malform == "stray_in_section")
    if malform == "text_after_section":
        assert kimi.decode(ids[ids.index(SE) + 1:-1]) == " Done."
    with pytest.raises(ValueError, match="malform must be one of"):
        ToolCaller(kimi, "typo")
