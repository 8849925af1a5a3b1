"""Prompt length as the target sees it, and what to do with prompts that cannot fit its context.

A prompt's length is its chat-template rendering with the generation prompt, tokenized by the
target's tokenizer: the ids every backend starts from. A prompt fits when that length plus the
tokens reserved for the reply is within the target's context; SGLang and OpenRouter refuse
(HTTP 400) a request that does not, and the local model would pad a whole batch to it.
Lengths are measured a chunk at a time in one batched tokenizer call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from eagle3_assets.prompts.rows import Prompt

OverContext = Literal["refuse", "skip", "truncate"]
TRUNCATE_ROUNDS = 8


@dataclass(frozen=True)
class ContextLimit:
    context_length: int | None  # the target's (None: unknown, nothing is checked)
    reserve: int  # tokens each prompt leaves free for the reply (max_new_tokens)

    @property
    def max_prompt_tokens(self) -> int | None:
        return None if self.context_length is None else self.context_length - self.reserve

    def describe(self, n: int) -> str:
        return (f"renders to {n:,} tokens with the target's chat template; with {self.reserve:,} reserved for the reply "
                f"that is over the target's context of {self.context_length:,}")


def _render_kwargs(tok) -> dict:
    return dict(tokenize=True, add_generation_prompt=True, return_dict=True, **tok.template_kwargs())


def rendered_lengths(tok, conversations: list[list[dict]], tools: list[list[dict] | None] | None = None) -> list[int | str]:
    """Each conversation's rendered prompt length, or why the chat template refuses it.

    Conversations without tools go through one batched call (the fast tokenizers encode a batch in
    parallel; only when the template raises for some conversation is the batch redone one by one
    to name it); those with tools, whose declarations differ from row to row, one by one.
    """
    tools = tools or [None] * len(conversations)
    out: list[int | str] = [0] * len(conversations)
    plain = [i for i, t in enumerate(tools) if not t]
    for i, n in zip(plain, _batched_lengths(tok, [conversations[i] for i in plain])):
        out[i] = n
    for i in (i for i, t in enumerate(tools) if t):
        out[i] = _one_length(tok, conversations[i], tools[i])
    return out


def _batched_lengths(tok, conversations: list[list[dict]]) -> list[int | str]:
    if not conversations:
        return []
    try:
        ids = tok.tokenizer.apply_chat_template(conversations, **_render_kwargs(tok))["input_ids"]
        return [len(x) for x in ids]
    except Exception:  # a template's raise_exception() (e.g. roles must alternate) or a bad turn
        return [_one_length(tok, conv, None) for conv in conversations]


def _one_length(tok, conversation: list[dict], tools: list[dict] | None) -> int | str:
    try:
        return len(tok.render_prompt(conversation, tools))
    except Exception as e:  # jinja2's TemplateError and whatever a template raises
        return f"the target's chat template refuses it: {str(e).strip() or type(e).__name__}"


def truncate_last_turn(tok, prompt: Prompt, max_tokens: int) -> Prompt | None:
    """The prompt with its last user turn cut in the middle (head and tail kept, so both an opening
    instruction and a closing question survive) until it renders within ``max_tokens``; None when
    the other turns alone leave no room."""
    *history, last = prompt.messages
    content, n = last["content"], prompt.prompt_tokens
    content_tokens = len(tok.tokenizer(content, add_special_tokens=False)["input_ids"])
    if n - content_tokens >= max_tokens:
        return None
    for _ in range(TRUNCATE_ROUNDS):
        over = n - max_tokens
        if over <= 0:
            return replace(prompt, messages=[*history, {**last, "content": content}], prompt_tokens=n, truncated=True)
        chars_per_token = len(content) / max(content_tokens, 1)
        cut = math.ceil(over * chars_per_token) + 1
        if cut >= len(content):
            return None
        keep = len(content) - cut
        content = content[: keep - keep // 2] + content[len(content) - keep // 2:]
        content_tokens = len(tok.tokenizer(content, add_special_tokens=False)["input_ids"])
        n = len(tok.render_prompt([*history, {**last, "content": content}], prompt.tools))
    return None
