"""Tools in a prompt: declarations, the history's calls and the results that answer them.

Everything ends in OpenAI's shape, whatever the file held (OpenAI ``tools``/``tool_calls``/
``tool`` turns, ShareGPT ``function_call``/``observation`` turns, glaive's text):

- a declaration is ``{"type": "function", "function": {"name", "description"?, "parameters"?}}``
  (a bare ``{"name", "parameters"}`` is wrapped); anything else is refused;
- a call is ``{"id", "type": "function", "function": {"name", "arguments"}}`` with ``arguments``
  a JSON string (an object given as such is written as JSON); a call without an id gets Kimi's own
  form, ``functions.<name>:<n>`` with ``n`` counting the conversation's calls from 0;
- a result is ``{"role": "tool", "tool_call_id", "content"}`` and must answer a call made before it
  (one without ``tool_call_id`` answers the oldest unanswered call).

Each refusal is a :class:`RowError` naming the field, counted in the reader's one summary.
"""

from __future__ import annotations

import json

from eagle3_assets.prompts.problems import RowError

NOT_A_TOOL = "tool is not a function definition"
NO_NAME = "tool call without a function name"
BAD_ARGUMENTS = "tool call arguments are not JSON"
ORPHAN_RESULT = "tool result answering no call"


def _kind(v) -> str:
    return "nothing" if v is None else type(v).__name__


def json_values(text: str, where: str, kind: str) -> list:
    """Every JSON value in ``text``, one after another (glaive and function-calling dumps write
    several function definitions back to back)."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return out
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise RowError(where, f"not valid JSON ({e.msg} at character {e.pos})", kind) from None
        out.append(value)


def read_tools(value, where: str) -> list[dict] | None:
    """A row's tool declarations (a list, one object, or JSON text of either), normalized; None when empty."""
    if value is None or (isinstance(value, (str, list)) and not value):
        return None
    if isinstance(value, str):
        values = json_values(value, where, NOT_A_TOOL)
        value = values[0] if len(values) == 1 and isinstance(values[0], list) else values
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        raise RowError(where, f"must be a list of function definitions, got {_kind(value)}", NOT_A_TOOL)
    return [_tool(t, f"{where}[{i}]") for i, t in enumerate(value)] or None


def _tool(t, where: str) -> dict:
    if not isinstance(t, dict):
        raise RowError(where, f"must be a function definition object, got {_kind(t)}", NOT_A_TOOL)
    if "function" in t or "type" in t:
        if t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise RowError(where, f"only {{\"type\": \"function\", \"function\": {{...}}}} tools can be declared, "
                                  f"got type {t.get('type')!r}", NOT_A_TOOL)
        fn, where = dict(t["function"]), f"{where}.function"
    else:
        fn = dict(t)
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
        raise RowError(f"{where}.name", f"a function needs a name, got {name!r}", NOT_A_TOOL)
    params = fn.get("parameters")
    if isinstance(params, str):
        params = json_values(params, f"{where}.parameters", NOT_A_TOOL)
        params = params[0] if len(params) == 1 else params
    if params is not None and not isinstance(params, dict):
        raise RowError(f"{where}.parameters", f"must be a JSON schema object, got {_kind(params)}", NOT_A_TOOL)
    if params is not None:
        fn["parameters"] = params
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise RowError(f"{where}.description", f"must be text, got {_kind(fn['description'])}", NOT_A_TOOL)
    return {"type": "function", "function": fn}


class ToolTurns:
    """The calls and results of one conversation, read in order: numbers the calls, checks that
    every result answers one."""

    def __init__(self):
        self.calls = 0
        self.results = 0
        self.ids: dict[str, str] = {}  # call id -> function name
        self.pending: list[str] = []  # calls not answered yet, oldest first

    def calls_of(self, raw, where: str) -> list[dict]:
        """An assistant turn's ``tool_calls`` (a list, or one call) normalized."""
        if isinstance(raw, dict):
            raw = [raw]
        if not isinstance(raw, list) or not raw:
            raise RowError(where, f"must be a non-empty list of calls, got {_kind(raw)}", NO_NAME)
        return [self._call(c, f"{where}[{i}]") for i, c in enumerate(raw)]

    def _call(self, c, where: str) -> dict:
        if not isinstance(c, dict):
            raise RowError(where, f"must be a call object, got {_kind(c)}", NO_NAME)
        fn, fwhere = (c["function"], f"{where}.function") if isinstance(c.get("function"), dict) else (c, where)
        name = fn.get("name")
        if not isinstance(name, str) or not name.strip():
            raise RowError(f"{fwhere}.name", f"a tool call needs the name of the function it calls, got {name!r}",
                           NO_NAME)
        args = arguments_json(fn.get("arguments", fn.get("parameters")), f"{fwhere}.arguments")
        cid = c.get("id")
        if not isinstance(cid, str) or not cid.strip():
            from eagle3_assets.target.tool_calls import kimi_call_id

            cid = kimi_call_id(name, self.calls)  # K2.5's count-based id, the one rule
        self.calls += 1
        self.ids[cid] = name
        self.pending.append(cid)
        return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}

    def answer(self, call_id, where: str) -> str:
        """The id of the call a result answers (``call_id`` given, else the oldest unanswered)."""
        if call_id is None or call_id == "":
            if not self.pending:
                raise RowError(where, "a tool result with no call before it to answer", ORPHAN_RESULT)
            call_id = self.pending[0]
        elif call_id not in self.ids:
            known = ", ".join(map(repr, list(self.ids)[:5])) or "none"
            raise RowError(where, f"answers call {call_id!r}, which no earlier assistant turn made (calls: {known})",
                           ORPHAN_RESULT)
        if call_id in self.pending:
            self.pending.remove(call_id)
        self.results += 1
        return str(call_id)


def arguments_json(args, where: str) -> str:
    """A call's arguments as the JSON text of an object (OpenAI's ``arguments`` string)."""
    if args is None:
        return "{}"
    if isinstance(args, dict):
        return json.dumps(args, ensure_ascii=False)
    if not isinstance(args, str):
        raise RowError(where, f"must be a JSON object or its text, got {_kind(args)}", BAD_ARGUMENTS)
    try:
        value = json.loads(args)
    except json.JSONDecodeError as e:
        shown = args if len(args) <= 60 else args[:57] + "..."
        raise RowError(where, f"not valid JSON ({e.msg} at character {e.pos}): {shown!r}", BAD_ARGUMENTS) from None
    if not isinstance(value, dict):
        raise RowError(where, f"must be a JSON object, got {_kind(value)}", BAD_ARGUMENTS)
    return args


def result_text(content, where: str) -> str:
    """A tool result's content: text, or JSON written as text."""
    if isinstance(content, str):
        return content
    if content is None:
        raise RowError(where, "a tool result needs content", "content is not text")
    return json.dumps(content, ensure_ascii=False)


def tool_figures(messages: list[dict], tools: list | None) -> dict:
    """What the ``prompts`` metadata counts per row: declarations, calls, results."""
    calls = sum(len(m.get("tool_calls") or ()) for m in messages)
    return {"tools": len(tools or ()), "tool_calls": calls, "tool_results": sum(m["role"] == "tool" for m in messages)}


SYSTEM_TURN_HEADER = ("You can call the functions declared below. To call one, answer with "
                      '<tool_call>{"name": <function name>, "arguments": <JSON object>}</tool_call>; '
                      "each result comes back in a tool turn.\n<tools>\n")


def has_tool_content(messages: list[dict], tools: list | None) -> bool:
    return bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def declare_in_system_turn(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation for a chat template that renders no tools: the declarations written into
    the system turn (one JSON definition a line), each history call into its assistant turn's text
    as ``<tool_call>{...}</tool_call>``, tool results kept as ``tool`` turns."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            written = [json.dumps({"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])},
                                  ensure_ascii=False) for c in m.pop("tool_calls")]
            m["content"] = "\n".join([m["content"]] * bool(m["content"]) + [f"<tool_call>{w}</tool_call>" for w in written])
        if m["role"] == "tool":
            m = {"role": "tool", "content": m["content"]}
        out.append(m)
    if tools:
        block = SYSTEM_TURN_HEADER + "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools) + "\n</tools>"
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
