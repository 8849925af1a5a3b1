"""glaive-function-calling-v2 rows: a ``system`` text that declares functions and a ``chat`` text of turns.

``system`` is ``SYSTEM: <prose>`` followed by zero or more JSON function definitions written one
after another; ``chat`` holds ``USER:``, ``ASSISTANT:`` and ``FUNCTION RESPONSE:`` turns, assistant
turns ending in ``<|endoftext|>``, a call written as ``ASSISTANT: <functioncall> {"name": ...,
"arguments": '{...}'}`` (the arguments often a single-quoted JSON string, which is not JSON).
The row becomes the system prose as a system turn, the definitions as tools, and the turns in
OpenAI's shape; :mod:`eagle3_assets.prompts.rows` then checks them like any other row.

A row is read this way when the column map names its ``chat`` column, or when it has a ``chat``
text and neither ``messages`` nor ``conversations``.
"""

from __future__ import annotations

import json
import re

from eagle3_assets.prompts.problems import RowError
from eagle3_assets.prompts.tools import BAD_ARGUMENTS, json_values, read_tools

TURN = re.compile(r"(?:^|\n)[ \t]*(USER|ASSISTANT|FUNCTION RESPONSE):[ \t]*")
ROLES = {"USER": "user", "ASSISTANT": "assistant", "FUNCTION RESPONSE": "tool"}
END_OF_TEXT = "<|endoftext|>"
CALL_MARK = "<functioncall>"
SYSTEM_PREFIX = "SYSTEM:"
QUOTED_ARGUMENTS = re.compile(r"""("arguments"\s*:\s*)'(.*)'(\s*\}\s*)$""", re.S)


def is_glaive_row(row: dict, cols) -> bool:
    if cols.chat:
        return True
    return isinstance(row.get("chat"), str) and row.get(cols.messages) is None and row.get(cols.conversations) is None


def glaive_conversation(row: dict, cols) -> tuple[list[dict], list[dict], list[dict] | None]:
    """(system turn, the chat's turns, the declared tools) of one glaive row."""
    chat_col, system_col = cols.chat or "chat", cols.system or "system"
    chat = row.get(chat_col)
    if not isinstance(chat, str):
        raise RowError(chat_col, f"glaive's chat must be text, got {type(chat).__name__}", "content is not text")
    system = row.get(system_col)
    if system is not None and not isinstance(system, str):
        raise RowError(system_col, f"glaive's system must be text, got {type(system).__name__}", "content is not text")
    prose, tools = split_system(system or "", system_col)
    return ([{"role": "system", "content": prose}] if prose else []), chat_turns(chat, chat_col), tools


def split_system(text: str, where: str) -> tuple[str, list[dict] | None]:
    """The system prose and the function definitions after it."""
    text = text.strip()
    if text.startswith(SYSTEM_PREFIX):
        text = text[len(SYSTEM_PREFIX):].strip()
    start = text.find("{")
    if start < 0:
        return text, None
    prose = text[:start].rstrip().removesuffix("-").rstrip()
    return prose, read_tools(text[start:], where)


def chat_turns(chat: str, where: str) -> list[dict]:
    pieces = TURN.split(chat)
    if pieces[0].strip():
        raise RowError(where, f"text before the first USER:/ASSISTANT: turn: {pieces[0].strip()[:40]!r}", "no messages")
    turns = []
    for k, (marker, text) in enumerate(zip(pieces[1::2], pieces[2::2])):
        text = text.replace(END_OF_TEXT, "").strip()
        role = ROLES[marker]
        if role == "assistant" and CALL_MARK in text:
            content, calls = _calls_in_turn(text, f"{where}[{k}]")
            turns.append({"role": "assistant", "content": content, "tool_calls": calls})
        else:
            turns.append({"role": role, "content": text})
    return turns


def _calls_in_turn(text: str, where: str) -> tuple[str, list]:
    """(the turn's text, its calls): every ``<functioncall> {...}`` in it, the text around them kept
    as the content (glaive writes a sentence after the call JSON now and then)."""
    texts, calls = [], []
    rest = text
    while CALL_MARK in rest:
        before, _, rest = rest.partition(CALL_MARK)
        texts.append(before.strip())
        end = call_object_end(rest)
        found = call_from_text(rest[:end], where)
        calls += found if isinstance(found, list) else [found]
        rest = rest[end:]
    texts.append(rest.strip())
    return "\n".join(t for t in texts if t), calls


def call_object_end(text: str) -> int:
    """Where the call object at the start of ``text`` ends: braces counted outside strings, a
    string opened by ``"`` or by glaive's ``'`` (after a colon), with backslash escapes. The whole
    text when the braces never close (then the call is refused as not JSON)."""
    depth, quote, i, prev = 0, None, 0, ""
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = None
        elif ch == '"' or (ch == "'" and prev == ":"):
            quote = ch
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        if not ch.isspace():
            prev = ch
        i += 1
    return len(text)


def call_from_text(value, where: str):
    """One call (or a list of them) from its JSON text, repairing glaive's single-quoted arguments."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    try:
        values = json_values(text, where, BAD_ARGUMENTS)
    except RowError:
        # the arguments as a JSON string; glaive escapes apostrophes in them as \' (not a JSON escape)
        fixed = QUOTED_ARGUMENTS.sub(lambda m: m.group(1) + json.dumps(m.group(2).replace("\\'", "'")) + m.group(3),
                                     text)
        try:
            values = [json.loads(fixed)]
        except json.JSONDecodeError as e:
            shown = text if len(text) <= 60 else text[:57] + "..."
            raise RowError(where, f"the call is not JSON ({e.msg}): {shown!r}", BAD_ARGUMENTS) from None
    return values[0] if len(values) == 1 else values
