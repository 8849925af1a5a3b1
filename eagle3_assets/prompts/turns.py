"""A prompt per assistant turn: each conversation becomes the prefix before every reply in it.

With one prompt per conversation the target answers only its last turn, usually a text answer
after a tool result, so the target's own tool calls are rarely generated. Read per assistant
turn, the target makes its own call at every call point and its own answer after every result.

The turn prompts of one conversation share its id, with ``@turn<k>`` after it (``k`` counts
the conversation's prompts from 0), and carry the conversation's id in the prompt table's
``conversation_id`` column, so the train/eval split keeps every prompt of a conversation on one
side without reading ids apart (a file's own id may end in ``@turn3``). :func:`conversation_id`
reads ids apart only for tables written before that column, as the split did then.
"""

from __future__ import annotations

import re
from dataclasses import replace

from eagle3_assets.prompts.rows import LAST_ROLES, Prompt

TURN_MARK = "@turn"
_TURN_SUFFIX = re.compile(re.escape(TURN_MARK) + r"\d+$")


def turn_prompt_id(conversation: str, k: int) -> str:
    return f"{conversation}{TURN_MARK}{k}"


def conversation_id(prompt_id: str) -> str:
    """The conversation a prompt comes from, read from its id alone (tables without a
    ``conversation_id`` column): the id without the ``@turn<k>`` suffix."""
    return _TURN_SUFFIX.sub("", prompt_id)


def _usable_end(messages: list[dict]) -> bool:
    last = messages[-1]
    return last["role"] in LAST_ROLES and (last["role"] != "user" or bool(last["content"].strip()))


def assistant_turn_prompts(prompt: Prompt, conversation: list[dict]) -> list[Prompt]:
    """One prompt per assistant turn of ``conversation`` (the prefix before it, which must end with
    a user turn or a tool result), and the whole conversation when it ends with one itself."""
    prefixes = [conversation[:i] for i in range(1, len(conversation))
                if conversation[i]["role"] == "assistant" and _usable_end(conversation[:i])]
    if _usable_end(conversation):
        prefixes.append(conversation)
    return [replace(prompt, prompt_id=turn_prompt_id(prompt.prompt_id, k), messages=list(p), dropped_replies=0,
                    conversation_id=prompt.prompt_id)
            for k, p in enumerate(prefixes)]


def prompts_per_conversation_rows(counts) -> list[dict]:
    """The ``prompts`` metadata table: how many conversations gave how many prompts."""
    return [{"prompts": n, "conversations": c} for n, c in sorted(counts.items())]
