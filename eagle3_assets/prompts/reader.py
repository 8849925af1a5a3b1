"""Reading prompt files: OpenAI-style and ShareGPT rows, normalized to one shape.

Every row becomes ``(prompt_id, messages)`` where messages are ``{"role", "content"}`` dicts
with roles ``system``/``user``/``assistant`` and the last turn is the user's. A bad row raises
:class:`PromptFileError` naming the file, line and field, or is skipped and counted.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

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
}
CHAT_ROLES = {"system", "user", "assistant"}


class PromptFileError(ValueError):
    """A prompt row that cannot be used; the message names file, line and field."""

    def __init__(self, path: Path | str, line: int, field_name: str, reason: str):
        self.path, self.line, self.field, self.reason = str(path), line, field_name, reason
        super().__init__(f"{path}, line {line}, field '{field_name}': {reason}")


@dataclass
class Prompt:
    prompt_id: str
    messages: list[dict]
    line: int


@dataclass
class PromptFile:
    prompts: list[Prompt]
    skipped: list[PromptFileError] = field(default_factory=list)
    lines: int = 0


def content_hash_id(messages: list[dict]) -> str:
    """Stable id for a row without one: a hash of its canonical messages."""
    canon = json.dumps(messages, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return "h" + hashlib.sha256(canon.encode("utf-8")).hexdigest()[:16]


def _messages_from_openai(row: dict, err) -> list[dict]:
    raw = row["messages"]
    if not isinstance(raw, list) or not raw:
        raise err("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise err(f"messages[{i}]", "must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise err(f"messages[{i}].role", f"unknown role {role!r} (expected one of {sorted(CHAT_ROLES)})")
        if not isinstance(content, str):
            raise err(f"messages[{i}].content", "must be a string")
        out.append({"role": role, "content": content})
    return out


def _messages_from_sharegpt(row: dict, err) -> list[dict]:
    raw = row["conversations"]
    if not isinstance(raw, list) or not raw:
        raise err("conversations", "must be a non-empty list of {from, value} objects")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise err(f"conversations[{i}]", "must be an object with 'from' and 'value'")
        who, value = m.get("from"), m.get("value")
        role = SHAREGPT_ROLES.get(str(who).lower()) if who is not None else None
        if role is None:
            raise err(f"conversations[{i}].from", f"unknown speaker {who!r} (expected human/gpt/system)")
        if not isinstance(value, str):
            raise err(f"conversations[{i}].value", "must be a string")
        out.append({"role": role, "content": value})
    return out


def parse_prompt_line(text: str, path: Path | str, line: int) -> Prompt:
    """Parse one JSONL line into a :class:`Prompt` or raise :class:`PromptFileError`."""

    def err(field_name: str, reason: str) -> PromptFileError:
        return PromptFileError(path, line, field_name, reason)

    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise err("(line)", f"not valid JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(row, dict):
        raise err("(line)", "must be a JSON object")
    if "messages" in row:
        messages = _messages_from_openai(row, err)
        where = "messages"
    elif "conversations" in row:
        messages = _messages_from_sharegpt(row, err)
        where = "conversations"
    else:
        raise err("messages", "row has neither 'messages' (OpenAI style) nor 'conversations' (ShareGPT)")
    last = len(messages) - 1
    if messages[-1]["role"] != "user":
        raise err(f"{where}[{last}]", f"the last turn must be the user's, got {messages[-1]['role']!r}")
    if not messages[-1]["content"].strip():
        raise err(f"{where}[{last}]", "the last user turn is empty")
    pid = row.get("id")
    if pid is None:
        pid = content_hash_id(messages)
    elif isinstance(pid, (str, int)) and not isinstance(pid, bool) and str(pid).strip():
        pid = str(pid)
    else:
        raise err("id", f"must be a non-empty string or integer, got {pid!r}")
    return Prompt(prompt_id=pid, messages=messages, line=line)


def read_prompt_file(path: Path | str, *, skip_invalid: bool = False) -> PromptFile:
    """Read a prompt JSONL file. Raises on the first bad row unless ``skip_invalid``."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    result = PromptFile(prompts=[])
    seen: dict[str, int] = {}
    with path.open("rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            result.lines = line_no
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                problem = PromptFileError(path, line_no, "(line)", f"not UTF-8 ({e.reason} at byte {e.start})")
            else:
                if not text.strip():
                    continue
                try:
                    prompt = parse_prompt_line(text, path, line_no)
                    if prompt.prompt_id in seen:
                        raise PromptFileError(
                            path, line_no, "id",
                            f"duplicate prompt id {prompt.prompt_id!r} (first seen on line {seen[prompt.prompt_id]})",
                        )
                    seen[prompt.prompt_id] = line_no
                    result.prompts.append(prompt)
                    continue
                except PromptFileError as e:
                    problem = e
            if not skip_invalid:
                raise problem
            result.skipped.append(problem)
    if not result.prompts:
        raise PromptFileError(path, result.lines, "(file)", "no usable prompt rows")
    return result
