"""Tool-call replies as token ids: the template's own rendering of the assistant message.

A reply that calls tools is made of ids no text encoding reproduces on its own (Kimi: the
``<|tool_calls_section_begin|>`` ... markers around ``functions.<name>:<index>`` ids and the
arguments). So its training sequence, when the backend returned only text and structured
``tool_calls`` (OpenRouter), is what the target's chat template makes of that assistant message:
the conversation rendered with the reply minus the conversation rendered with the generation
prompt. Rows with native ids keep them; their calls are read back (the server's parser for vLLM,
the ids themselves for SGLang and local rows) and re-rendered the same way, so the agreement of
this reconstruction is measured where it can be (the formats: :mod:`eagle3_assets.target.tool_calls`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eagle3_assets.target.tool_calls import KimiFormat, reply_calls


@dataclass
class ToolReply:
    """A tool-call reply rebuilt by the template: its ids, the calls and how it was made."""

    ids: list[int]
    calls: list[dict]
    notes: list[str] = field(default_factory=list)


def render_reply(tok, messages: list[dict], tools: list[dict] | None, reply: dict,
                 prompt_ids: list[int]) -> list[int] | None:
    """The ids the template writes for ``reply`` after the conversation (None when the rendering
    with the reply does not start with the rendered prompt: a template that is not append-only)."""
    kwargs = {"tools": tools} if tools else {}
    full = tok.tokenizer.apply_chat_template([*messages, reply], tokenize=True, add_generation_prompt=False,
                                             return_dict=True, **kwargs, **tok.template_kwargs())["input_ids"]
    full = list(full)
    if full[:len(prompt_ids)] != list(prompt_ids):
        return None
    return full[len(prompt_ids):]


def tool_call_reply(tok, row: dict, messages: list[dict] | None, tools: list[dict] | None,
                    prompt_ids: list[int]) -> ToolReply | None:
    """The template's rendering of a row's tool-call reply, or None when the row calls no tool
    (or its calls cannot be rendered: no prompt messages, a template that is not append-only)."""
    kimi = KimiFormat.of(tok)
    native = row.get("output_ids")
    calls, notes = reply_calls(row.get("tool_calls")), []
    text, reasoning = row.get("text") or "", row.get("reasoning")
    if native is not None and kimi is not None:
        head, parsed, leftovers = kimi.split_counted(tok, list(native))
        if leftovers:
            notes.append(f"{leftovers} id(s) in the tool-call section outside any call, ignored")
        if parsed is not None:  # the text and reasoning are read from the ids too: exact
            notes.append("tool calls from the server's parser" if calls else "tool calls read from the ids")
            calls, text, reasoning = calls or parsed, tok.decode(head), None
    if not calls or messages is None:
        return None
    if kimi is not None:
        before = sum(len(m.get("tool_calls") or ()) for m in messages)
        calls, changed = kimi.kimi_ids(calls, before)
        if changed:
            notes.append("tool-call ids rebuilt as functions.<name>:<index>")
    reasoning, text, _ = tok.split_thinking({**row, "text": text, "reasoning": reasoning}, prompt_ids)
    reply = {"role": "assistant", "content": text or "", "tool_calls": calls}
    if reasoning:
        reply["reasoning_content"] = reasoning
    ids = render_reply(tok, messages, tools, reply, prompt_ids)
    if ids is None:
        return None
    if (row.get("finish_reason") or "") != "stop" and ids and ids[-1] == tok.end_of_turn_id:
        ids = ids[:-1]  # the template closes the turn; a reply cut short never did
    return ToolReply(ids, calls, notes + [f"template rendering of {len(calls)} tool call(s)"])
