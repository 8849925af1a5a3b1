"""Token-exact training sequences: prompt ids + output ids, loss mask, agreement figures.

A training sequence is the locally rendered prompt plus the backend's own output ids. Only when a
backend returned no ids is the completion rebuilt from its text, and every row that has ids is also
re-tokenized from its text so the drift is measured, not assumed (the contract is the target
tokenizer's, :mod:`eagle3_assets.target.tokenizer`).
"""

from __future__ import annotations

import difflib

from eagle3_assets.target.tokenizer import TargetTokenizer
from eagle3_assets.tokens.tool_replies import tool_call_reply


class ContextLengthError(ValueError):
    """A sequence does not fit the model's context and truncation was not configured."""


def token_agreement(reference: list[int], candidate: list[int]) -> tuple[int, int]:
    """(matched, total): tokens in the longest-common alignment vs the longer sequence."""
    total = max(len(reference), len(candidate))
    if total == 0:
        return 0, 0
    sm = difflib.SequenceMatcher(a=reference, b=candidate, autojunk=False)
    matched = sum(b.size for b in sm.get_matching_blocks())
    return matched, total


def first_difference(tok: TargetTokenizer, a: list[int], b: list[int]) -> str:
    """A short readable description of where two id sequences first differ."""
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if i == len(a) == len(b):
        return ""
    return (
        f"at token {i}: native {a[i:i + 4]} {tok.decode(a[i:i + 4])!r} "
        f"vs re-tokenized {b[i:i + 4]} {tok.decode(b[i:i + 4])!r}"
    )


def build_token_row(row: dict, messages: list[dict] | None, tok: TargetTokenizer, *, tools: list[dict] | None = None,
                    max_length: int | None = None, truncate: bool = False) -> dict:
    """One token row from one response row (the token_ids contract in docs/datasets.md).

    A reply that calls tools is rebuilt by the chat template (:mod:`eagle3_assets.tokens.tool_replies`);
    ``tools`` are the prompt's declarations, rendered with it.

    ``max_length``: the longest sequence allowed (None: the model's context, if known; 0: no
    limit). A longer sequence raises ``ContextLengthError`` naming the sample and the lengths,
    unless ``truncate``: then the completion is cut at ``max_length``. A prompt that alone
    fills ``max_length`` leaves nothing to supervise and always raises.
    """
    sid = row["sample_id"]
    notes: list[str] = []
    prompt_ids = row.get("prompt_ids")
    if not prompt_ids:
        if messages is None:
            raise ValueError(f"sample {sid}: no prompt ids and prompt {row.get('prompt_id')!r} is unknown")
        prompt_ids = tok.render_prompt(messages, tools)
        notes.append("prompt rendered locally")
    finish = row.get("finish_reason") or ""
    native = row.get("output_ids")
    if native and finish == "stop" and (row.get("text") or "").endswith(tok.end_of_turn) \
            and native[-1] == tok.end_of_turn_id:
        # the server kept the stop token in its text (SGLang no_stop_trim): the layout adds it back
        row = {**row, "text": row["text"][: -len(tok.end_of_turn)]}
        notes.append("stop token trimmed from text")
    reasoning, text, think_closed = tok.split_thinking(row, prompt_ids)
    if think_closed is not None:
        notes.append("reasoning split from text at </think>" if think_closed else "think block never closed")
    layout = tok.completion_layout(prompt_ids, reasoning, text, finish, think_closed)
    reply = tool_call_reply(tok, row, messages, tools, prompt_ids) if row.get("tool_calls") or native else None
    if row.get("tool_calls") and reply is None:
        why = "no prompt messages, or a template whose rendering is not append-only"
        if native is None:  # without the calls the row would be wrong, not merely uncalibrated
            raise ValueError(f"sample {sid}: its reply calls tools, but the chat template cannot render it after the "
                             f"prompt ({why})")
        notes.append(f"tool calls not re-rendered ({why}): calibrated as text")
    if reply is not None:
        layout, retok = ["tool_call_reply"], reply.ids
        notes += reply.notes
    else:
        retok = tok.retokenize_completion(text, finish, reasoning=reasoning, prompt_ids=prompt_ids,
                                          think_closed=think_closed)
    literals = tok.literal_specials(text) + (tok.literal_specials(reasoning) if "reasoning" in layout else [])
    if literals:
        notes.append("literal special strings in text encoded as special ids: "
                     + ", ".join(f"{n} x{literals.count(n)}" for n in sorted(set(literals))))
    if native is not None:
        completion, built_from = list(native), "native"
        matched, total = token_agreement(completion, retok)
        diff = first_difference(tok, completion, retok) if completion != retok else ""
        notes.append("calibrated against " + "+".join(layout))
    else:
        completion, built_from = retok, "retokenized"
        matched = total = 0
        diff = ""
        notes.append("completion = " + "+".join(layout))
        if reasoning and reply is None and "reasoning" not in layout:
            notes.append("reasoning dropped: " + ("the generation prompt closed the think block"
                                                  if tok.has_think_tokens else "no think tokens in this tokenizer"))
    if not completion:
        notes.append("empty completion")
    limit = tok.context_length if max_length is None else (max_length or None)
    n_total = len(prompt_ids) + len(completion)
    if limit is not None and n_total > limit:
        prompt_fills = len(prompt_ids) >= limit
        if not truncate or prompt_fills:
            raise ContextLengthError(
                f"sample {sid} (prompt {row.get('prompt_id')!r}): prompt {len(prompt_ids)} + completion "
                f"{len(completion)} = {n_total} tokens exceeds max_length {limit}; "
                + ("the prompt alone fills it, nothing left to supervise" if prompt_fills
                   else "set truncate to cut the completion at max_length")
            )
        completion = completion[: limit - len(prompt_ids)]
        notes.append(f"truncated from {n_total} to {limit} tokens (finish_reason {finish!r} -> 'length')")
        finish = "length"
    input_ids = list(prompt_ids) + completion
    return {
        "sample_id": sid,
        "dataset": row["dataset"],
        "prompt_id": row["prompt_id"],
        "sample_index": row.get("sample_index", 0),
        "source": row["source"],
        "model": row.get("model"),
        "finish_reason": finish or row.get("finish_reason"),
        "input_ids": input_ids,
        "loss_mask": [0] * len(prompt_ids) + [1] * len(completion),
        "prompt_len": len(prompt_ids),
        "completion_len": len(completion),
        "text_len": len(row.get("text") or ""),
        "literal_specials": len(literals),
        "has_tools": bool(tools),
        "tool_calls": len(reply.calls) if reply is not None else 0,
        "native_ids": built_from == "native",
        "built_from": built_from,
        "build_notes": "; ".join(notes),
        "retok_matched": matched,
        "retok_total": total,
        "retok_exact": built_from == "native" and list(native) == retok,
        "retok_diff": diff,
    }
