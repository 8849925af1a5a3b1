"""Tools on the wire: what a request sends, what a reply's calls become on its row, what is counted.

A request for a prompt with tools sends them (OpenAI-compatible backends as ``tools``; SGLang in
the rendered ids). A reply's calls are kept structured on the row (``tool_calls``, OpenAI's
shape, arguments as the JSON text the model wrote) beside its text and reasoning; ``finish_reason``
``tool_calls`` is a normal end (``stop``). Two row flags let a run see a backend that ignores tools:
``tools_sent`` on every row whose prompt had tools, ``tools_unused`` on those whose last turn is
the user's and whose reply calls nothing (after a tool result a text answer is the rule, so those
are not counted); a provider that drops ``tools`` answers every one of them without a call.
"""

from __future__ import annotations

TOOLS_SENT, TOOLS_UNUSED, CALLED = "tools_sent", "tools_unused", "tool_call_reply"


def tool_flags(req, calls) -> list[str]:
    """The row flags about tools (see the module docstring)."""
    flags = [CALLED] if calls else []
    if req.tools:
        flags.append(TOOLS_SENT)
        if not calls and req.messages and req.messages[-1].get("role") == "user":
            flags.append(TOOLS_UNUSED)
    return flags


def unused_tools_line(dataset: str, flags: dict) -> str | None:
    """A warning when prompts with tools were answered without any call."""
    sent, unused = flags.get(TOOLS_SENT, 0), flags.get(TOOLS_UNUSED, 0)
    if not unused:
        return None
    line = (f"{dataset}: {unused:,} replies to prompts with tools called no tool although the user's turn was "
            f"last ({sent:,} replies to prompts with tools in all)")
    if not flags.get(CALLED, 0):
        line += ("; not one call: a backend that ignores `tools` looks like this (OpenRouter routes with "
                 "require_parameters when tools are sent; check the provider and the model's tool support)")
    return line
