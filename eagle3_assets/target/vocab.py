"""Looking a token up as one vocabulary entry: the piece both the tokenizer wrapper and the
tool-call formats need (Kimi's markers are looked up the same way as the end-of-turn token)."""

from __future__ import annotations


class SpecialTokenError(ValueError):
    pass


def lookup_token_id(tokenizer, token: str) -> int:
    """The id of ``token`` as one vocabulary entry; never the unknown-token fallback."""
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or tokenizer.convert_ids_to_tokens(tid) != token:
        raise SpecialTokenError(f"{token!r} is not a single token of this tokenizer")
    return int(tid)


def optional_token_id(tokenizer, token: str) -> int | None:
    try:
        return lookup_token_id(tokenizer, token)
    except SpecialTokenError:
        return None
