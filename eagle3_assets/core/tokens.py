"""Token-exact training sequences: prompt ids + output ids, loss mask, agreement figures.

A training sequence is the locally rendered prompt plus the backend's own output ids.
Only when a backend returned no ids is the completion rebuilt from its text, and every row
that has ids is also re-tokenized from its text so the drift is measured, not assumed.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path


class SpecialTokenError(ValueError):
    pass


@dataclass
class TargetTokenizer:
    """The target's tokenizer plus the facts the checks rely on."""

    tokenizer: object
    end_of_turn: str
    end_of_turn_id: int
    source: str

    @classmethod
    def load(cls, path: Path | str, *, end_of_turn: str = "", trust_remote_code: bool = False):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        eot = end_of_turn or tok.eos_token
        if not eot:
            raise SpecialTokenError(f"{path}: tokenizer has no eos_token; configure end_of_turn explicitly")
        return cls(tok, eot, lookup_token_id(tok, eot), str(path))

    @property
    def name(self) -> str:
        """The target's name as sample ids record it: the model directory's name."""
        from pathlib import Path

        return Path(self.source).name

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def special_ids(self) -> set[int]:
        return {i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special}

    def render_prompt(self, messages: list[dict]) -> list[int]:
        enc = self.tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=True
        )
        return list(enc["input_ids"])

    def encode_text(self, text: str) -> list[int]:
        """Ids of plain text; literal special-token strings stay text, never special ids."""
        if not text:
            return []
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def retokenize_completion(self, text: str, finish_reason: str) -> list[int]:
        """Completion ids rebuilt from text: the text's ids, then end-of-turn if it stopped."""
        ids = self.encode_text(text or "")
        if finish_reason == "stop":
            ids.append(self.end_of_turn_id)
        return ids


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


def build_token_row(row: dict, messages: list[dict] | None, tok: TargetTokenizer) -> dict:
    """One token row from one response row (DESIGN section 5)."""
    sid = row["sample_id"]
    prompt_ids = row.get("prompt_ids")
    if not prompt_ids:
        if messages is None:
            raise ValueError(f"sample {sid}: no prompt ids and prompt {row.get('prompt_id')!r} is unknown")
        prompt_ids = tok.render_prompt(messages)
    retok = tok.retokenize_completion(row.get("text") or "", row.get("finish_reason") or "")
    native = row.get("output_ids")
    if native is not None:
        completion, built_from = list(native), "native"
        matched, total = token_agreement(completion, retok)
        diff = first_difference(tok, completion, retok) if completion != retok else ""
    else:
        completion, built_from = retok, "retokenized"
        matched = total = 0
        diff = ""
    input_ids = list(prompt_ids) + completion
    return {
        "sample_id": sid,
        "dataset": row["dataset"],
        "prompt_id": row["prompt_id"],
        "sample_index": row.get("sample_index", 0),
        "source": row["source"],
        "model": row.get("model"),
        "finish_reason": row.get("finish_reason"),
        "input_ids": input_ids,
        "loss_mask": [0] * len(prompt_ids) + [1] * len(completion),
        "prompt_len": len(prompt_ids),
        "completion_len": len(completion),
        "text_len": len(row.get("text") or ""),
        "native_ids": built_from == "native",
        "built_from": built_from,
        "retok_matched": matched,
        "retok_total": total,
        "retok_exact": built_from == "native" and completion == retok,
        "retok_diff": diff,
    }
