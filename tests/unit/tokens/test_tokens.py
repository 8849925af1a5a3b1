import pytest

from eagle3_assets.target.tokenizer import SpecialTokenError, lookup_token_id
from eagle3_assets.tokens.rows import build_token_row, token_agreement


def test_token_agreement_is_alignment_based():
    assert token_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == (4, 4)
    assert token_agreement([1, 2, 3, 4], [1, 9, 3, 4]) == (3, 4)
    # one inserted token shifts everything after it; alignment still matches the tail
    assert token_agreement([1, 2, 3, 4, 5], [1, 2, 7, 3, 4, 5]) == (5, 6)
    assert token_agreement([], []) == (0, 0)


def test_end_of_turn_is_looked_up_never_the_unknown_fallback(target_tokenizer):
    tok = target_tokenizer
    assert tok.end_of_turn == "<|im_end|>"
    assert tok.decode([tok.end_of_turn_id]) == "<|im_end|>"
    with pytest.raises(SpecialTokenError, match="not a single token"):
        lookup_token_id(tok.tokenizer, "<|no_such_token|>")


def test_literal_special_strings_in_text_are_encoded_as_the_tokenizer_does(target_tokenizer):
    # the tokenizer's own encode maps a literal special string to its id (Kimi's always does);
    # the row flags it (tests/unit/tokens/test_retokenization.py) and the text still decodes unchanged
    tok = target_tokenizer
    ids = tok.encode_text("ends with <|im_end|> here")
    assert ids.count(tok.end_of_turn_id) == 1 and tok.literal_specials("ends with <|im_end|> here") == ["<|im_end|>"]
    assert tok.decode(ids) == "ends with <|im_end|> here"


def test_native_row_keeps_ids_and_measures_retokenization(target_tokenizer):
    tok = target_tokenizer
    prompt = tok.render_prompt([{"role": "user", "content": "Hi"}])
    output = tok.encode_text("Hello there!") + [tok.end_of_turn_id]
    row = {"sample_id": "s1", "dataset": "d", "prompt_id": "p", "source": "local",
           "prompt_ids": prompt, "output_ids": output, "text": "Hello there!", "finish_reason": "stop"}
    t = build_token_row(row, None, tok)
    assert t["input_ids"] == prompt + output
    assert t["loss_mask"] == [0] * len(prompt) + [1] * len(output)
    assert t["native_ids"] and t["retok_exact"] and t["retok_matched"] == t["retok_total"] == len(output)


def test_non_canonical_native_ids_show_up_as_drift(target_tokenizer):
    tok = target_tokenizer
    # "Hello" spelled with two tokens instead of one: same text, different ids
    pieces = tok.encode_text("Hel") + tok.encode_text("lo")
    canonical = tok.encode_text("Hello")
    assert pieces != canonical
    row = {"sample_id": "s", "dataset": "d", "prompt_id": "p", "source": "local", "prompt_ids": [1],
           "output_ids": pieces + [tok.end_of_turn_id], "text": "Hello", "finish_reason": "stop"}
    t = build_token_row(row, None, tok)
    assert not t["retok_exact"] and t["retok_matched"] < t["retok_total"]
    assert "at token" in t["retok_diff"]


def test_text_only_row_is_rebuilt_with_end_of_turn(target_tokenizer):
    tok = target_tokenizer
    msgs = [{"role": "user", "content": "Hi"}]
    row = {"sample_id": "s", "dataset": "d", "prompt_id": "p", "source": "openrouter",
           "prompt_ids": None, "output_ids": None, "text": "Fine.", "finish_reason": "stop"}
    t = build_token_row(row, msgs, tok)
    assert t["built_from"] == "retokenized" and not t["native_ids"]
    assert t["input_ids"][-1] == tok.end_of_turn_id
    assert t["input_ids"][: t["prompt_len"]] == tok.render_prompt(msgs)
    cut = dict(row, finish_reason="length")
    assert build_token_row(cut, msgs, tok)["input_ids"][-1] != tok.end_of_turn_id
