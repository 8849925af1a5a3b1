"""Tool-call replies for the loopback servers: what a tool-using target writes when tools are declared.

The embedded test models never call tools by themselves, so the loopback writes the call the way
a Kimi-style model emits it, as ids: the model's own reply up to its ``</think>`` (closed if it
never was), then ``<|tool_calls_section_begin|>``, per call ``<|tool_call_begin|>functions.<name>:
<index><|tool_call_argument_begin|>`` + the arguments + ``<|tool_call_end|>``, then
``<|tool_calls_section_end|><|im_end|>``. The tools are read back from the rendered prompt (the
``tool_declare`` turn, TypeScript or JSON), as the model reads them; the call answers a user turn
(after a tool result the model answers in text). String arguments are spelled with ids the model
generated, not with the tokenizer's canonical encoding of the text, so a reply's ids differ from a
re-encoding of its text where a model's would: that is what re-rendering calls must cope with.
Everything is a deterministic function of the prompt and the model's output.

``malform`` writes the section the ways servers are seen to break it (see :data:`MALFORMED`),
so the parser's leniency and the re-rendering's agreement can be measured on such replies.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from .outputs import Output

DECLARE = "<|im_system|>tool_declare<|im_middle|>"
TS_FUNCTION = re.compile(r"^type (\S+) = \(_: \{(.*?)^\}\) => any;", re.M | re.S)
TS_FUNCTION_EMPTY = re.compile(r"^type (\S+) = \(_: \{\}\) => any;", re.M)
TS_FIELD = re.compile(r"^  (\w+)(\??): (.+?),?$", re.M)
SAFE_VALUE = re.compile(r"^ ?[A-Za-z0-9]+$")
JSON_KINDS = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean", "array": "Array<any>"}
MALFORMED = {  # how a Kimi tool-call section comes out broken, and what is written for it
    "whitespace": "a newline after the section begin, between calls and before the section end",
    "no_section_end": "the reply ends after the last call's <|tool_call_end|>, no <|tool_calls_section_end|>",
    "stray_in_section": "a few words between the calls and after the last one, inside the section",
    "text_after_section": "a sentence after <|tool_calls_section_end|>, before the end of turn",
}


@dataclass
class ToolReply:
    output_ids: list[int]
    reasoning: str | None  # before </think>, as a reasoning parser splits it
    content: str | None
    tool_calls: list[dict]
    reasoning_tokens: int = 0


def with_tool_calls(gen, prompt_ids: list[int], out):
    """``(out, None)``, or the generator's output turned into a tool-call reply and that reply."""
    make = getattr(gen, "tool_reply", None)
    reply = make(prompt_ids, out.output_ids) if make is not None else None
    if reply is None:
        return out, None
    return Output(reply.output_ids, "stop", reply.content or "", out.prompt_tokens), reply


def declared_tools(prompt_text: str) -> list[tuple[str, list[tuple[str, bool, str]]]]:
    """(name, [(field, required, type)]) of each function the prompt's tool_declare turn declares."""
    start = prompt_text.find(DECLARE)
    if start < 0:
        return []
    block = prompt_text[start + len(DECLARE):].split("<|im_end|>", 1)[0]
    if block.lstrip().startswith("["):  # the JSON fallback
        out = []
        for t in json.loads(block):
            fn = t.get("function") or t
            props = (fn.get("parameters") or {}).get("properties") or {}
            req = set((fn.get("parameters") or {}).get("required") or [])
            out.append((fn["name"], [(k, k in req, json.dumps(v["enum"][0]) if v.get("enum") else
                                      JSON_KINDS.get(v.get("type"), "{}")) for k, v in props.items()]))
        return out
    out = [(m.group(1), [(f.group(1), not f.group(2), f.group(3)) for f in TS_FIELD.finditer(m.group(2))])
           for m in TS_FUNCTION.finditer(block)]
    return out + [(m.group(1), []) for m in TS_FUNCTION_EMPTY.finditer(block)]


def last_turn_is_a_result(prompt_text: str) -> bool:
    """Whether the turn before the generation prompt is a tool result (``## Return of ...``)."""
    history = prompt_text[:prompt_text.rfind("<|im_assistant|>")]
    start = max(history.rfind(tag) for tag in ("<|im_user|>", "<|im_system|>", "<|im_assistant|>"))
    return history[start:].split("<|im_middle|>", 1)[-1].startswith("## Return of ")


class ToolCaller:
    """Writes the tool-call reply of one request; ``tok`` is the target's ``TargetTokenizer``."""

    def __init__(self, tok, malform: str | None = None):
        from eagle3_assets.target.tool_calls import KimiFormat

        if malform is not None and malform not in MALFORMED:
            raise ValueError(f"malform must be one of {sorted(MALFORMED)}, got {malform!r}")
        self.tok = tok
        self.fmt = KimiFormat.of(tok)
        self.malform = malform

    def reply(self, prompt_ids: list[int], output_ids: list[int]) -> ToolReply | None:
        """The reply with its calls, or None: no tools declared, the last turn a tool result, or a
        target without Kimi's tool-call markers."""
        if self.fmt is None:
            return None
        text = self.tok.decode(prompt_ids)
        tools = declared_tools(text)
        if not tools or last_turn_is_a_result(text):
            return None
        h = hashlib.sha256(json.dumps([prompt_ids[-256:], output_ids[:64]]).encode()).digest()
        body = [i for i in output_ids if i != self.tok.end_of_turn_id]
        head = self._head(prompt_ids, body, h)
        words = self._value_ids(body)
        n_calls = 2 if len(tools) > 1 and h[0] % 3 == 0 else 1
        before = text.count("<|tool_call_begin|>")
        gap = {"whitespace": self.tok.encode_text("\n"), "stray_in_section": self.tok.encode_text(" ok then")
               }.get(self.malform, [])
        section, calls = [self.fmt.section_begin, *(gap if self.malform == "whitespace" else [])], []
        for k in range(n_calls):
            name, fields = tools[(h[1] + k) % len(tools)]
            call_id, arguments = f"functions.{name}:{before + k}", self._arguments(fields, words, h[2 + k:])
            section += [self.fmt.call_begin, *self.tok.encode_text(call_id), self.fmt.argument_begin, *arguments,
                        self.fmt.call_end, *gap]
            # the calls as a provider's parser reports them, from what was written here (not read back
            # with the project's KimiFormat.split, which the project's re-rendering is checked against)
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": self.tok.decode(arguments)}})
        end = {"no_section_end": [], "text_after_section": [self.fmt.section_end, *self.tok.encode_text(" Done.")]
               }.get(self.malform, [self.fmt.section_end])
        ids = head + section + end + [self.tok.end_of_turn_id]
        pre = self.tok.decode(head)
        thinking = self.tok.opens_think(prompt_ids)
        reasoning, content = (pre.split("</think>", 1) + [""])[:2] if thinking else (None, pre)
        n_reasoning = head.index(self.tok.think_end_id) if thinking else 0
        return ToolReply(ids, reasoning, content or None, calls, n_reasoning)

    def _head(self, prompt_ids, body: list[int], h: bytes) -> list[int]:
        """The model's own text before the calls: its reasoning, closed, and a few words at most."""
        if not self.tok.opens_think(prompt_ids):
            return body[:h[5] % 4]
        end = self.tok.think_end_id
        reasoning = body[:body.index(end)] if end in body else body[:max(1, len(body) // 2)]
        after = body[body.index(end) + 1:] if end in body else []
        return reasoning + [end] + after[:h[5] % 4]

    def _value_ids(self, body: list[int]) -> list[list[int]]:
        """Runs of the model's ids that spell plain words: what string arguments are made of."""
        runs, run = [], []
        for i in body:
            if SAFE_VALUE.match(self.tok.decode([i]) or ""):
                run.append(i)
                if len(run) == 3:
                    runs.append(run)
                    run = []
            elif run:
                runs.append(run)
                run = []
        return [r for r in runs + [run] if r] or [self.tok.encode_text("loopback")]

    def _arguments(self, fields, words: list[list[int]], h: bytes) -> list[int]:
        """The arguments' ids: JSON punctuation and keys encoded, string values the model's ids."""
        chosen = [f for f in fields if f[1]] or fields[:1]
        ids, enc = [], self.tok.encode_text
        for j, (key, _, kind) in enumerate(chosen):
            ids += enc(("{" if j == 0 else ", ") + json.dumps(key) + ": ")
            if kind.startswith('"'):
                ids += enc(kind.split(" | ")[0])
            elif kind == "number":
                ids += enc(str(h[j % len(h)] % 50 + 1))
            elif kind == "boolean":
                ids += enc("true" if h[j % len(h)] % 2 else "false")
            elif kind.startswith("Array"):
                ids += enc("[") + enc('"') + words[j % len(words)] + enc('"]')
            elif kind == "string":
                ids += enc('"') + words[(h[j % len(h)] + j) % len(words)] + enc('"')
            else:
                ids += enc("{}")
        return ids + enc("}" if chosen else "{}")
