"""Token-exact training sequences: prompt ids + output ids, loss mask, agreement figures.

A training sequence is the locally rendered prompt plus the backend's own output ids.
Only when a backend returned no ids is the completion rebuilt from its text, and every row
that has ids is also re-tokenized from its text so the drift is measured, not assumed. The
re-tokenization used to calibrate (rows with ids) is the very function used to build rows
without ids (``TargetTokenizer.retokenize_completion``).

Re-tokenization contract (sglang-and-kimi.md sections C, D):
- the prompt is rendered with the chat template as the server does: ``tokenize=True`` and
  ``add_generation_prompt=True`` passed explicitly (Kimi's tokenizer overrides the defaults), the
  ``thinking`` template kwarg passed only when configured. Literal special-token strings in
  *prompt* messages (a user typing ``<|im_end|>``) become special ids, exactly as the server's own
  rendering tokenizes them, because those are the ids the target was conditioned on;
- the completion is tokenized with ``split_special_tokens=True``: literal special strings in the
  model's text stay text (a model cannot emit a special id as text pieces and have ``text`` show it,
  since servers skip special tokens when decoding). Non-special added tokens (Kimi's ``<think>``,
  ``</think>`` and tool-call markers, ``special=False``) still map to their ids, as Kimi's own
  encode does;
- reasoning is placed where the template's generating turn puts it: when the prompt ends with
  ``<think>`` (K2.5 thinking generation prompt) the completion is ``reasoning </think> text``;
  when the template has think tokens but the prompt does not open one and the row carries
  reasoning, the model emitted the whole block: ``<think> reasoning </think> text``; a
  tokenizer without think tokens gets ``text`` only. A completion that stopped gets the
  end-of-turn id (looked up by string) appended.
- multi-turn prompts: only the final, generated assistant turn is supervised (the loss mask
  covers the completion only). History turns are whatever the template renders for them (Kimi
  K2.5: ``<think></think>{content}``, reasoning dropped), because the prompt ids are the template's.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path

THINK_START = "<think>"
THINK_END = "</think>"
_SANE_MAX = 10_000_000  # tokenizers report 1e30 for "no limit"


class SpecialTokenError(ValueError):
    pass


class ContextLengthError(ValueError):
    """A sequence does not fit the model's context and truncation was not configured."""


@dataclass
class TargetTokenizer:
    """The target's tokenizer plus the facts the checks rely on.

    ``thinking``: None leaves the chat template's default; True/False is passed to the template as
    the ``thinking`` kwarg (Kimi K2.5's switch between ``<think>`` and ``<think></think>``).
    ``context_length``: the model's context from its ``config.json`` (``max_position_embeddings``)
    or a sane ``model_max_length``; None when unknown.
    """

    tokenizer: object
    end_of_turn: str
    end_of_turn_id: int
    source: str
    thinking: bool | None = None
    context_length: int | None = None
    think_start_id: int | None = field(default=None)
    think_end_id: int | None = field(default=None)

    @classmethod
    def load(cls, path: Path | str, *, end_of_turn: str = "", trust_remote_code: bool = False,
             thinking: bool | None = None, config_dir: Path | str | None = None):
        """``config_dir``: where the model's ``config.json`` (context length) is, when the tokenizer
        lives elsewhere; default ``path``."""
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        eot = end_of_turn or tok.eos_token
        if not eot:
            raise SpecialTokenError(f"{path}: tokenizer has no eos_token; configure end_of_turn explicitly")
        return cls(tok, eot, lookup_token_id(tok, eot), str(path), thinking=thinking,
                   context_length=_context_length(Path(config_dir or path), tok),
                   think_start_id=_optional_token_id(tok, THINK_START),
                   think_end_id=_optional_token_id(tok, THINK_END))

    @property
    def name(self) -> str:
        """The target's name as sample ids record it: the model directory's name."""
        return Path(self.source).name

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def special_ids(self) -> set[int]:
        return {i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special}

    @property
    def has_think_tokens(self) -> bool:
        return self.think_start_id is not None and self.think_end_id is not None

    def template_kwargs(self) -> dict:
        return {} if self.thinking is None else {"thinking": self.thinking}

    def render_prompt(self, messages: list[dict]) -> list[int]:
        enc = self.tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=True, **self.template_kwargs()
        )
        return list(enc["input_ids"])

    def encode_text(self, text: str) -> list[int]:
        """Ids of plain text; literal special-token strings stay text, never special ids."""
        if not text:
            return []
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    def decode(self, ids: list[int]) -> str:
        # no spaces around added tokens: Kimi's slow tokenizer otherwise decodes
        # "<think>ok</think>1" as " <think> ok </think> 1" (vllm#33457)
        return self.tokenizer.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False)

    def completion_layout(self, prompt_ids: list[int] | None, reasoning: str | None, text: str,
                          finish_reason: str) -> list[str]:
        """The parts a re-tokenized completion is made of, in order (see the module docstring)."""
        parts: list[str] = []
        stopped = finish_reason == "stop"
        last = prompt_ids[-1] if prompt_ids else None
        opens_think = self.has_think_tokens and last == self.think_start_id
        closed_think = self.has_think_tokens and last == self.think_end_id  # thinking=False prompt
        if opens_think:
            # generation started inside the think block; a turn cut before any answer text
            # may not have closed it yet
            parts.append("reasoning")
            if text or stopped:
                parts.append(THINK_END)
        elif reasoning and self.has_think_tokens and not closed_think:
            parts += [THINK_START, "reasoning", THINK_END]
        parts.append("text")
        if stopped:
            parts.append("end_of_turn")
        return parts

    def retokenize_completion(self, text: str, finish_reason: str, *, reasoning: str | None = None,
                              prompt_ids: list[int] | None = None) -> list[int]:
        """Completion ids rebuilt from text (and reasoning) the way the template's generating turn
        lays them out; end-of-turn appended if it stopped. Used for text-only rows *and* for the
        calibration of rows with native ids."""
        ids: list[int] = []
        for part in self.completion_layout(prompt_ids, reasoning, text or "", finish_reason or ""):
            if part == "reasoning":
                ids += self.encode_text(reasoning or "")
            elif part == "text":
                ids += self.encode_text(text or "")
            elif part == "end_of_turn":
                ids.append(self.end_of_turn_id)
            elif part == THINK_START:
                ids.append(self.think_start_id)
            elif part == THINK_END:
                ids.append(self.think_end_id)
        return ids

    def template_turn_end(self) -> tuple[str, int] | None:
        """The token the chat template closes an assistant turn with, or None if it cannot tell."""
        marker = "Zq9 marker"
        try:
            rendered = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": marker}],
                tokenize=False, add_generation_prompt=False, **self.template_kwargs())
        except Exception:  # no chat template, or one that rejects this conversation
            return None
        rest = rendered[rendered.rfind(marker) + len(marker):] if marker in rendered else ""
        ids = list(self.tokenizer.encode(rest, add_special_tokens=False)) if rest else []
        if not ids:
            return None
        return self.tokenizer.convert_ids_to_tokens(ids[0]), int(ids[0])


def _optional_token_id(tokenizer, token: str) -> int | None:
    try:
        return lookup_token_id(tokenizer, token)
    except SpecialTokenError:
        return None


def _context_length(path: Path, tokenizer) -> int | None:
    cfg = path / "config.json"
    if cfg.is_file():
        try:
            data = json.loads(cfg.read_text())
        except (OSError, ValueError):
            data = {}
        for d in (data, data.get("text_config") or {}):
            n = d.get("max_position_embeddings") or d.get("max_sequence_length")
            if isinstance(n, int) and n > 0:
                return n
    n = getattr(tokenizer, "model_max_length", None)
    return int(n) if isinstance(n, int) and 0 < n < _SANE_MAX else None


def lookup_token_id(tokenizer, token: str) -> int:
    """The id of ``token`` as one vocabulary entry; never the unknown-token fallback."""
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or tokenizer.convert_ids_to_tokens(tid) != token:
        raise SpecialTokenError(f"{token!r} is not a single token of this tokenizer")
    return int(tid)


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


def build_token_row(row: dict, messages: list[dict] | None, tok: TargetTokenizer, *,
                    max_length: int | None = None, truncate: bool = False) -> dict:
    """One token row from one response row (DESIGN section 5).

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
        prompt_ids = tok.render_prompt(messages)
        notes.append("prompt rendered locally")
    text, reasoning, finish = row.get("text") or "", row.get("reasoning"), row.get("finish_reason") or ""
    layout = tok.completion_layout(prompt_ids, reasoning, text, finish)
    retok = tok.retokenize_completion(text, finish, reasoning=reasoning, prompt_ids=prompt_ids)
    native = row.get("output_ids")
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
        if reasoning and "reasoning" not in layout:
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
        "text_len": len(text),
        "native_ids": built_from == "native",
        "built_from": built_from,
        "build_notes": "; ".join(notes),
        "retok_matched": matched,
        "retok_total": total,
        "retok_exact": built_from == "native" and list(native) == retok,
        "retok_diff": diff,
    }
