"""One row of a prompt file to one prompt: OpenAI, ShareGPT, glaive or mapped text columns, one shape out.

Every prompt becomes ``(prompt_id, messages, tools)`` with string contents and roles
``system``/``user``/``assistant``/``tool``, the last turn the user's or a tool result's. OpenAI
content given as a list of parts (``[{"type": "text", "text": ...}]``, as the API accepts it) is
joined into one string with newlines between the parts, the way vLLM flattens text parts, so every
backend receives the same text; a non-text part (image, audio, file) is refused, since the drafter
is trained on text. Tool declarations, calls and results are kept structured, in OpenAI's shape
(:mod:`eagle3_assets.prompts.tools`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from eagle3_assets.prompts.glaive import call_from_text, glaive_conversation, is_glaive_row
from eagle3_assets.prompts.options import ColumnMap
from eagle3_assets.prompts.problems import RowError
from eagle3_assets.prompts.tools import ToolTurns, read_tools, result_text

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    # tool turns: LLaMA-Factory's and glaive-derived ShareGPT files
    "function_call": "call", "function-call": "call", "tool_call": "call",
    "observation": "tool", "function-response": "tool", "function_response": "tool", "tool": "tool",
}
CHAT_ROLES = {"system", "user", "assistant", "tool"}
ROLE_ALIASES = {"developer": "system", "function": "tool"}  # OpenAI's newer name for system; its legacy result role
REASONING_KEYS = ("reasoning_content", "reasoning", "thought", "thinking")  # OpenAI/vLLM, OpenRouter, ShareGPT variants
LAST_ROLES = ("user", "tool")  # what a prompt may end with: the target answers either
TEXT_PART_TYPES = ("text", "input_text")
PART_SEPARATOR = "\n"
COLUMN_SEPARATOR = "\n\n"


@dataclass
class Prompt:
    prompt_id: str
    messages: list[dict]
    line: int  # line (JSONL) or row (Parquet) of the prompt file, 1-based
    tools: list[dict] | None = None  # declarations in OpenAI's shape, None when the row has none
    prompt_tokens: int | None = None  # rendered with the target's chat template, when measured
    truncated: bool = False  # the last user turn was shortened to fit the target's context
    dropped_replies: int = 0  # final assistant turns left out (final_assistant: drop); not stored
    conversation: list[dict] | None = None  # the whole conversation, replies included (per-turn reading); not stored
    conversation_id: str | None = None  # the conversation a per-assistant-turn prompt comes from; None: its own


def content_hash_id(messages: list[dict], tools: list[dict] | None = None) -> str:
    """Stable id for a row without one: a hash of its canonical messages (and tools, when it has some)."""
    canon = json.dumps(messages if not tools else [messages, tools], ensure_ascii=False, sort_keys=True,
                       separators=(",", ":"))
    return "h" + hashlib.sha256(canon.encode("utf-8")).hexdigest()[:16]


def content_text(content, where: str) -> str:
    """A message's content as one string: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RowError(where, f"must be a string or a list of text parts, got {_kind(content)}", "content is not text")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise RowError(f"{where}[{j}]", f"must be a {{type, text}} object, got {_kind(part)}", "content is not text")
        ptype = part.get("type", "text" if "text" in part else None)
        if ptype not in TEXT_PART_TYPES:
            raise RowError(f"{where}[{j}].type", f"a part of type {ptype!r} cannot be used: only text parts "
                                                 "(type 'text') are read, the drafter learns from text", "non-text content part")
        text = part.get("text")
        if not isinstance(text, str):
            raise RowError(f"{where}[{j}].text", f"must be a string, got {_kind(text)}", "content is not text")
        texts.append(text)
    return PART_SEPARATOR.join(texts)


def _kind(v) -> str:
    return "nothing" if v is None else type(v).__name__


def _turns(raw, where: str, speaker_key: str, text_key: str, shape: str) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise RowError(where, f"must be a non-empty list of {shape} objects", "no messages")
    out: list[dict] = []
    ledger = ToolTurns()
    sharegpt = speaker_key == "from"
    for i, m in enumerate(raw):
        at = f"{where}[{i}]"
        if not isinstance(m, dict):
            raise RowError(at, f"must be an object with {shape}", "no messages")
        # ShareGPT files also come with OpenAI keys inside ``conversations``; take either
        skey, tkey = (speaker_key, text_key) if speaker_key in m or "role" not in m else ("role", "content")
        who = m.get(skey)
        if sharegpt:
            role = SHAREGPT_ROLES.get(str(who).lower()) if who is not None else None
            if role is None:
                raise RowError(f"{at}.{skey}", f"unknown speaker {who!r} (expected human/gpt/system, or "
                                               "function_call/observation for tool turns)", "unknown role")
        else:
            role = ROLE_ALIASES.get(who, who)
            if role not in CHAT_ROLES:
                raise RowError(f"{at}.role", f"unknown role {who!r} (expected one of {sorted(CHAT_ROLES)})",
                               "unknown role")
        if role != "assistant" and role != "call":
            _no_reasoning(m, at, role)
        if role == "call":  # a ShareGPT call turn: the assistant's, joined to its text turn just before
            calls = ledger.calls_of(call_from_text(m.get(tkey), f"{at}.{tkey}"), f"{at}.{tkey}")
            if out and out[-1]["role"] == "assistant" and not out[-1].get("tool_calls"):
                out[-1]["tool_calls"] = calls
                _join_reasoning(out[-1], reasoning_of(m, at))
            else:
                out.append(_with_reasoning({"role": "assistant", "content": "", "tool_calls": calls}, m, at))
        elif role == "tool":
            content = result_text(m.get(tkey), f"{at}.{tkey}")
            call_id = ledger.answer(m.get("tool_call_id"), f"{at}.tool_call_id")
            msg = {"role": "tool", "tool_call_id": call_id, "content": content}
            # named after the function whose call it answers, as Kimi's template renders results
            name = m.get("name") if isinstance(m.get("name"), str) and m["name"] else ledger.ids.get(call_id)
            if name:
                msg["name"] = name
            out.append(msg)
        elif role == "assistant" and (m.get("tool_calls") or m.get("function_call")):
            content = m.get(tkey)
            calls = m.get("tool_calls") or m["function_call"]  # function_call: OpenAI's legacy single call
            out.append(_with_reasoning(
                {"role": "assistant", "content": "" if content is None else content_text(content, f"{at}.{tkey}"),
                 "tool_calls": ledger.calls_of(calls, f"{at}.tool_calls")}, m, at))
        elif role == "assistant":
            out.append(_with_reasoning({"role": role, "content": content_text(m.get(tkey), f"{at}.{tkey}")}, m, at))
        else:
            out.append({"role": role, "content": content_text(m.get(tkey), f"{at}.{tkey}")})
    return out


def reasoning_of(m: dict, where: str) -> str | None:
    """An assistant turn's reasoning, from whichever field its format keeps it in: ``reasoning_content``
    (OpenAI-compatible servers, Moonshot), ``reasoning`` or ``reasoning_details`` (OpenRouter), or a
    ShareGPT thought field (``thought``/``thinking``)."""
    for key in REASONING_KEYS:
        value = m.get(key)
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise RowError(f"{where}.{key}", f"must be text, got {_kind(value)}", "reasoning is not text")
        return value
    details = m.get("reasoning_details")
    if details:
        if not isinstance(details, list) or not all(isinstance(d, dict) for d in details):
            raise RowError(f"{where}.reasoning_details", "must be a list of {type, text} objects",
                           "reasoning is not text")
        text = "".join(d.get("text") or d.get("summary") or "" for d in details
                       if d.get("type") != "reasoning.encrypted")
        return text or None
    return None


def _with_reasoning(msg: dict, m: dict, where: str) -> dict:
    reasoning = reasoning_of(m, where)
    if reasoning:
        msg["reasoning_content"] = reasoning
    return msg


def _join_reasoning(msg: dict, reasoning: str | None) -> None:
    """A call turn's reasoning onto the assistant turn it joins (after that turn's own, when it differs)."""
    if not reasoning:
        return
    own = msg.get("reasoning_content")
    msg["reasoning_content"] = reasoning if not own or own == reasoning else f"{own}\n\n{reasoning}"


def _no_reasoning(m: dict, where: str, role: str) -> None:
    """Reasoning on a turn that is not the assistant's has no place in the conversation: a counted bad
    row rather than text dropped without a word."""
    for key in (*REASONING_KEYS, "reasoning_details"):
        if m.get(key) not in (None, "", []):
            raise RowError(f"{where}.{key}", f"reasoning on a {role!r} turn: only the assistant's turns carry "
                                             "reasoning, so it cannot be placed (move it to the assistant turn, or "
                                             "drop the field)", "reasoning that cannot be placed")


def _from_columns(row: dict, cols: ColumnMap) -> tuple[list[dict], str]:
    texts = []
    for col in cols.user:
        if col not in row:
            raise RowError(col, "missing (the column map names it)", "missing column")
        value = row[col]
        if value is not None and not isinstance(value, str):
            raise RowError(col, f"must be text, got {_kind(value)}", "content is not text")
        if value and value.strip():
            texts.append(value)
    return [{"role": "user", "content": COLUMN_SEPARATOR.join(texts)}], cols.user[-1]


def _system_from_column(row: dict, cols: ColumnMap, messages: list[dict]) -> list[dict]:
    value = row.get(cols.system)
    if value is not None and not isinstance(value, str):
        raise RowError(cols.system, f"must be text, got {_kind(value)}", "content is not text")
    if not value or not value.strip() or messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": value}, *messages]


def parse_row(row: dict, number: int, cols: ColumnMap | None = None, *, drop_final_assistant: bool = False,
              keep_conversation: bool = False) -> Prompt:
    """One row as a :class:`Prompt`, or :class:`RowError` naming the field; ``keep_conversation``
    also keeps the whole conversation (final replies included) for per-turn prompts."""
    cols = cols or ColumnMap()
    tools = read_tools(row.get(cols.tools), cols.tools)
    if cols.user:
        messages, where = _from_columns(row, cols)
        last_field = where
    else:
        if row.get(cols.messages) is not None:
            where = cols.messages
            messages = _turns(row[where], where, "role", "content", "'role' and 'content'")
        elif row.get(cols.conversations) is not None:
            where = cols.conversations
            messages = _turns(row[where], where, "from", "value", "'from' and 'value'")
        elif is_glaive_row(row, cols):
            where = cols.chat or "chat"
            system, turns, declared = glaive_conversation(row, cols)
            messages = system + _turns(turns, where, "role", "content", "turn")
            tools = declared
        else:
            raise RowError(cols.messages, f"row has neither {cols.messages!r} (OpenAI style) nor {cols.conversations!r} "
                                          "(ShareGPT) nor glaive's 'system' and 'chat'; name your columns with --map",
                           "no messages")
        last_field = None
    dropped, whole = 0, messages
    if drop_final_assistant or keep_conversation:
        while messages and messages[-1]["role"] == "assistant":
            messages, dropped = messages[:-1], dropped + 1
        if not messages:
            raise RowError(where, "has no user turn, only the assistant's", "last turn is not the user's")
    last_field = last_field or f"{where}[{len(messages) - 1}]"
    if messages[-1]["role"] not in LAST_ROLES:
        got = messages[-1]["role"]
        hint = ("; to regenerate that reply, read the file with final_assistant: drop (--drop-final-assistant)"
                if got == "assistant" else "")
        raise RowError(last_field, f"the last turn must be the user's (or a tool result), got {got!r}{hint}",
                       "last turn is not the user's")
    if messages[-1]["role"] == "user" and not messages[-1]["content"].strip():
        raise RowError(last_field, "the last user turn is empty", "empty user turn")
    if cols.system:
        messages, whole = _system_from_column(row, cols, messages), _system_from_column(row, cols, whole)
    return Prompt(prompt_id=_prompt_id(row.get(cols.id), messages, tools, cols.id), messages=messages, line=number,
                  tools=tools, dropped_replies=dropped, conversation=whole if keep_conversation else None)


def _prompt_id(pid, messages: list[dict], tools: list[dict] | None, field: str) -> str:
    if pid is None:
        return content_hash_id(messages, tools)
    if isinstance(pid, float) and pid.is_integer():  # integer ids that went through pandas
        pid = int(pid)
    if isinstance(pid, (str, int)) and not isinstance(pid, bool) and str(pid).strip():
        return str(pid)
    raise RowError(field, f"must be a non-empty string or integer, got {pid!r}", "bad id")
