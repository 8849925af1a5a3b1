"""The tool-call formats: OpenAI's call shape, whether a template renders tools, Kimi-K2's section and ids.

Every stage reads calls in these shapes (prompts rewrite history ids, generation normalizes a
reply's calls, tokens parse and rebuild them); the rebuilding of a reply by the template is the
tokens stage's (:mod:`eagle3_assets.tokens.tool_replies`).

Where the format is known (Kimi), calls are also parsed from ids, and every provider call id is
rebuilt as ``functions.<name>:<index>``, ``index`` counting the conversation's calls, since that is
what the model writes (:func:`kimi_call_id`, one rule): in replies, in the history's calls and
the results that answer them by :func:`kimi_history_ids` (the prompt table is written with them).
"""

from __future__ import annotations

import json
import re
from collections import deque
from dataclasses import dataclass

from eagle3_assets.target.vocab import SpecialTokenError, lookup_token_id

KIMI_MARKERS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>")
KIMI_ID = re.compile(r"^functions\.(?P<name>.+):(?P<index>\d+)$")
VLLM_ID = re.compile(r"^.+:\d+$")  # the header vLLM's kimi_k2 parser takes for a call (``_TOOL_ID_RE``)
PROBE_TOOL = {"type": "function", "function": {"name": "zq_probe_tool", "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}


def reply_calls(raw) -> list[dict] | None:
    """An OpenAI ``message.tool_calls`` list normalized (None when there is none)."""
    if not raw:
        return None
    out = []
    for c in raw:
        fn = (c or {}).get("function") or {}
        args = fn.get("arguments")
        out.append({"id": c.get("id") or "", "type": "function",
                    "function": {"name": fn.get("name") or "",
                                 "arguments": args if isinstance(args, str) else json.dumps(args or {}, ensure_ascii=False)}})
    return out


def template_renders_tools(tokenizer, template_kwargs: dict | None = None) -> bool:
    """True when passing ``tools`` changes the template's rendering (it declares them somewhere)."""
    msgs = [{"role": "user", "content": "Hi"}]
    kwargs = dict(tokenize=False, add_generation_prompt=True, **(template_kwargs or {}))
    try:
        plain = tokenizer.apply_chat_template(msgs, **kwargs)
        with_tools = tokenizer.apply_chat_template(msgs, tools=[PROBE_TOOL], **kwargs)
    except Exception:  # no chat template, or one that refuses tools
        return False
    return plain != with_tools


@dataclass
class KimiFormat:
    """Kimi-K2's tool-call section, by the ids of its five markers."""

    section_begin: int
    section_end: int
    call_begin: int
    argument_begin: int
    call_end: int

    @classmethod
    def of(cls, tok) -> KimiFormat | None:
        """The format of a :class:`TargetTokenizer` that has Kimi's markers (looked up once), else None."""
        if "_kimi_format" not in tok.__dict__:
            try:
                found = cls(*(lookup_token_id(tok.tokenizer, m) for m in KIMI_MARKERS))
            except SpecialTokenError:
                found = None
            tok.__dict__["_kimi_format"] = found
        return tok.__dict__["_kimi_format"]

    def split(self, tok, ids: list[int]) -> tuple[list[int], list[dict] | None]:
        """(the ids before the tool-call section, the calls in it); calls None when there is no
        section or no call can be read from it."""
        head, calls, _ = self.split_counted(tok, ids)
        return head, calls

    def split_counted(self, tok, ids: list[int]) -> tuple[list[int], list[dict] | None, int]:
        """:meth:`split` and the count of ids in the section that belong to no call (leftovers).

        As lenient as vLLM's ``kimi_k2`` parser: ids between the markers (whitespace, stray text) are
        skipped, a missing ``<|tool_calls_section_end|>`` ends the section at the reply's end, the
        section end closes a call whose ``<|tool_call_end|>`` is missing, and a call header that is not
        ``<name>:<index>`` (vLLM's id pattern) or has no arguments marker is no call; without a section end
the end-of-turn id closes the section, as the stop token ends the text vLLM parses. Leftovers are
        the skipped ids that are not whitespace; the caller counts them."""
        if self.section_begin not in ids:
            return ids, None, 0
        start = ids.index(self.section_begin)
        body = ids[start + 1:]
        if self.section_end in body:
            body = body[:body.index(self.section_end)]
        elif getattr(tok, "end_of_turn_id", None) in body:  # no section end: the turn's end closes it
            body = body[:body.index(tok.end_of_turn_id)]
        calls, skipped, i = [], [], 0
        while i < len(body):
            if body[i] != self.call_begin:
                skipped.append(body[i])
                i += 1
                continue
            nxt = next((j for j in range(i + 1, len(body)) if body[j] in (self.call_begin, self.call_end)), len(body))
            closed = nxt < len(body) and body[nxt] == self.call_end
            span = body[i + 1:nxt]
            if self.argument_begin in span and (closed or nxt == len(body) and self.section_end in ids[start:]):
                arg = span.index(self.argument_begin)
                cid = tok.decode(span[:arg]).strip()
                if VLLM_ID.match(cid):
                    m = KIMI_ID.match(cid)
                    name = m.group("name") if m else cid.rsplit(":", 1)[0].split(".")[-1]
                    calls.append({"id": cid, "type": "function",
                                  "function": {"name": name, "arguments": tok.decode(span[arg + 1:]) or "{}"}})
                else:
                    skipped += span
            else:
                skipped += span
            i = nxt + 1 if closed else nxt
        leftovers = sum(1 for t in skipped if tok.decode([t]).strip())
        return ids[:start], calls or None, leftovers

    @staticmethod
    def kimi_ids(calls: list[dict], before: int) -> tuple[list[dict], bool]:
        """Calls with K2.5's ids, ``functions.<name>:<before + k>`` (:func:`kimi_call_id`), whatever
        id the provider gave (``call_...``, ``name:i``, ``functions.name:i``: a provider's index
        restarts each turn, so keeping it would give two calls of one conversation the same id);
        True when any changed."""
        out, changed = [], False
        for k, c in enumerate(calls):
            out.append({**c, "id": kimi_call_id(c["function"]["name"], before + k)})
            changed |= out[-1]["id"] != c.get("id")
        return out, changed


def kimi_call_id(name: str, index: int) -> str:
    """K2.5's id of the conversation's ``index``-th call (from 0): ``functions.<name>:<index>``, the
    one rule for history calls and replies alike."""
    return f"functions.{name}:{index}"


def kimi_history_ids(messages: list[dict]) -> tuple[list[dict], int]:
    """The conversation with its history calls in Kimi's id form, each result's ``tool_call_id``
    following its call; and how many ids changed.

    K2.5 writes a history call's id verbatim (``<|tool_call_begin|>ID`` and ``## Return of ID``) and
    writes its own as ``functions.<name>:<index>`` (the form in Moonshot's tool-call guide), the
    index counting the conversation's calls from 0: what SGLang's and vLLM's chat serving put in
    a new call's id (the history's call count; SGLang PR 10612). So every history call gets that
    id, whatever the file had (``call_...``, a provider's ``name:0`` restarting each turn, repeats),
    and each result the id of the call it answers: the oldest call not yet answered that had the
    result's id in the file."""
    out, waiting, last, changed, index = [], {}, {}, 0, 0
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                old, cid = c.get("id"), kimi_call_id(c['function']['name'], index)
                index += 1
                changed += cid != old
                waiting.setdefault(old, deque()).append(cid)
                last[old] = cid
                calls.append({**c, "id": cid})
            m = {**m, "tool_calls": calls}
        elif m.get("role") == "tool" and m.get("tool_call_id") in last:
            tid = m["tool_call_id"]
            m = {**m, "tool_call_id": waiting[tid].popleft() if waiting[tid] else last[tid]}
        out.append(m)
    return out, changed
