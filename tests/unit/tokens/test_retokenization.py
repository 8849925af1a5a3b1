"""Re-tokenization of text-only rows, its calibration against native ids, and adversarial text.

Two tokenizers: the embedded SmolLM2 (ChatML, no think tokens) and the ``kimi-mini`` target's
tokenizer (Kimi K2.5's ids, encode semantics and chat template over a small BPE, loaded as remote
code like the real one).
"""

import dagster as dg
import duckdb
import polars as pl
import pytest

from eagle3_assets.target.tokenizer import TargetTokenizer
from eagle3_assets.tokens.checks import special_token_result
from eagle3_assets.tokens.rows import ContextLengthError, build_token_row
from eagle3_assets.tokens.table import TOKEN_SCHEMA
from tests.support.kimi_tokenizer import KIMI_SLOTS, build_kimi_test_tokenizer

SYSTEM = {"role": "system", "content": "You are Kimi."}


@pytest.fixture(scope="session")
def kimi_dir(tmp_path_factory):
    return build_kimi_test_tokenizer(tmp_path_factory.mktemp("kimi") / "Kimi-Test")


@pytest.fixture(scope="session")
def kimi(kimi_dir):
    # trust_remote_code as a real Kimi checkpoint needs it; harmless for this local tokenizer
    return TargetTokenizer.load(kimi_dir, end_of_turn="<|im_end|>", trust_remote_code=True)


@pytest.fixture(scope="session")
def kimi_no_think(kimi_dir):
    return TargetTokenizer.load(kimi_dir, end_of_turn="<|im_end|>", thinking=False, trust_remote_code=True)


@pytest.fixture(params=["smollm2", "kimi"])
def any_tok(request, target_tokenizer, kimi):
    return target_tokenizer if request.param == "smollm2" else kimi


def row(**kw):
    base = {"sample_id": "s", "dataset": "d", "prompt_id": "p", "source": "openrouter",
            "prompt_ids": None, "output_ids": None, "text": "", "reasoning": None, "finish_reason": "stop"}
    return {**base, **kw}


def _id(tok, s):
    return tok.tokenizer.convert_tokens_to_ids(s)


# --- the Kimi test tokenizer -----------------------------------------------------------------

def test_kimi_test_tokenizer_mirrors_kimis_layout(kimi):
    t = kimi.tokenizer
    base = _id(kimi, "[BOS]")
    assert base == 163584 and len(t) == 163840  # Kimi's real ids, not just its relative layout
    for slot, (name, special) in KIMI_SLOTS.items():
        assert _id(kimi, name) == base + slot, name
        assert t.added_tokens_decoder[base + slot].special is special, name
    added = t.added_tokens_encoder
    assert all(i < base for tok, i in t.get_vocab().items() if tok not in added)
    assert len(added) == 256 and t.convert_ids_to_tokens(base + 5) == "<|reserved_token_163589|>"
    assert t.eos_token == "[EOS]" and kimi.end_of_turn_id == base + 2 != _id(kimi, "[EOS]")
    assert (kimi.think_start_id, kimi.think_end_id) == (base + 22, base + 23)
    assert kimi.context_length == 4096 and kimi.thinking is None
    assert {base + 22, base + 23, base + 13}.isdisjoint(kimi.special_ids) and base + 2 in kimi.special_ids


def test_kimi_chat_template_structure(kimi, kimi_no_think):
    msgs = [SYSTEM, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello", "reasoning_content": "greet back"},
            {"role": "user", "content": "2+3?"}]
    text = kimi.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_system|>system<|im_middle|>You are Kimi.<|im_end|>"
                    "<|im_user|>user<|im_middle|>Hi<|im_end|>"
                    "<|im_assistant|>assistant<|im_middle|><think></think>Hello<|im_end|>"  # history: reasoning dropped
                    "<|im_user|>user<|im_middle|>2+3?<|im_end|>"
                    "<|im_assistant|>assistant<|im_middle|><think>")
    assert kimi.render_prompt(msgs)[-1] == kimi.think_start_id
    off = kimi_no_think.render_prompt(msgs)
    assert off[-2:] == [kimi.think_start_id, kimi.think_end_id]
    # K2.5 splits history at the last assistant turn that is not a tool call: a finished final
    # answer is history too (the stand-in this replaced split at the last user message)
    done = msgs[:2] + [{"role": "assistant", "content": "Hello", "reasoning_content": "greet back"}]
    rendered = kimi.tokenizer.apply_chat_template(done, tokenize=False, add_generation_prompt=False)
    assert rendered.endswith("<|im_assistant|>assistant<|im_middle|><think></think>Hello<|im_end|>")
    # preserve_thinking and a `reasoning` key are Kimi-K2.6's; K2.5's template reads neither
    # (transformers itself copies `reasoning` into `reasoning_content`; the prompt reader keeps neither)
    kept = kimi.tokenizer.apply_chat_template(done, tokenize=False, add_generation_prompt=False, preserve_thinking=True)
    assert kept == rendered
    template = kimi.tokenizer.chat_template
    assert "preserve_thinking" not in template and "get('reasoning')" not in template


# --- re-tokenization layout ------------------------------------------------------------------

def test_kimi_text_only_row_with_reasoning_matches_the_rendered_conversation(kimi):
    msgs = [SYSTEM, {"role": "user", "content": "What is 2+3?"}]
    r = row(text="The answer is 5.", reasoning="Add 2 and 3: 5.")
    t = build_token_row(r, msgs, kimi)
    assert t["built_from"] == "retokenized" and "reasoning+</think>+text+end_of_turn" in t["build_notes"]
    completion = t["input_ids"][t["prompt_len"]:]
    assert completion == (kimi.encode_text("Add 2 and 3: 5.") + [kimi.think_end_id]
                          + kimi.encode_text("The answer is 5.") + [kimi.end_of_turn_id])
    # prompt + completion is what the model saw and wrote: the generation prompt, then its reasoning;
    # a K2.5 re-render makes the finished answer history and drops the reasoning the model
    # generated: re-rendering a text answer is not append-only, so it is never used
    assert kimi.decode(t["input_ids"]) == (kimi.tokenizer.apply_chat_template(msgs, tokenize=False)
                                           + "Add 2 and 3: 5.</think>The answer is 5.<|im_end|>")
    full = msgs + [{"role": "assistant", "content": "The answer is 5.", "reasoning_content": "Add 2 and 3: 5."}]
    plain = kimi.tokenizer.apply_chat_template(full, tokenize=True, add_generation_prompt=False, return_dict=True)
    assert list(plain["input_ids"]) != t["input_ids"]
    assert t["loss_mask"] == [0] * t["prompt_len"] + [1] * len(completion)


def test_kimi_thinking_off_and_missing_reasoning(kimi, kimi_no_think):
    msgs = [{"role": "user", "content": "Hi"}]
    off = build_token_row(row(text="Hello", reasoning="ignored"), msgs, kimi_no_think)
    assert off["input_ids"][off["prompt_len"]:] == kimi.encode_text("Hello") + [kimi.end_of_turn_id]
    assert "generation prompt closed the think block" in off["build_notes"]
    # thinking on but the server reported no reasoning: the model still closed the think block
    empty_r = build_token_row(row(text="Hello"), msgs, kimi)
    assert empty_r["input_ids"][empty_r["prompt_len"]:] == [kimi.think_end_id] + kimi.encode_text("Hello") + [kimi.end_of_turn_id]
    # cut inside the reasoning: no </think>, no end of turn
    cut = build_token_row(row(text="", reasoning="Let me think", finish_reason="length"), msgs, kimi)
    assert cut["input_ids"][cut["prompt_len"]:] == kimi.encode_text("Let me think")
    # a template without a generation-prompt <think> (K2-Thinking style) gets the whole block
    ids = kimi.retokenize_completion("A", "stop", reasoning="R", prompt_ids=[1, 2])
    assert ids == ([kimi.think_start_id] + kimi.encode_text("R") + [kimi.think_end_id] + kimi.encode_text("A")
                   + [kimi.end_of_turn_id])


def test_smollm2_has_no_think_tokens_so_reasoning_is_dropped(target_tokenizer):
    tok = target_tokenizer
    assert not tok.has_think_tokens
    t = build_token_row(row(text="Fine.", reasoning="hmm"), [{"role": "user", "content": "Hi"}], tok)
    assert t["input_ids"][t["prompt_len"]:] == tok.encode_text("Fine.") + [tok.end_of_turn_id]
    assert "no think tokens" in t["build_notes"]


def test_calibration_uses_the_same_retokenization_as_text_only_rows(kimi, monkeypatch):
    msgs = [{"role": "user", "content": "Hi"}]
    prompt = kimi.render_prompt(msgs)
    calls = []
    real = TargetTokenizer.retokenize_completion

    def spy(self, *a, **kw):
        calls.append((a, kw))
        return real(self, *a, **kw)

    monkeypatch.setattr(TargetTokenizer, "retokenize_completion", spy)
    native_ids = real(kimi, "Hello", "stop", reasoning="R", prompt_ids=prompt)
    a = build_token_row(row(text="Hello", reasoning="R", prompt_ids=prompt, output_ids=native_ids, source="sglang"), None, kimi)
    b = build_token_row(row(text="Hello", reasoning="R"), msgs, kimi)
    assert calls[0] == calls[1]
    assert a["retok_exact"] and a["input_ids"] == b["input_ids"]
    assert a["built_from"] == "native" and a["retok_matched"] == a["retok_total"] == len(native_ids)


def test_multi_turn_supervises_only_the_final_turn(kimi):
    msgs = [SYSTEM, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello", "reasoning_content": "SECRET history reasoning"},
            {"role": "user", "content": "Bye"}]
    t = build_token_row(row(text="Goodbye", reasoning="end"), msgs, kimi)
    prompt_text = kimi.decode(t["input_ids"][: t["prompt_len"]])
    assert "SECRET" not in prompt_text and "<think></think>Hello<|im_end|>" in prompt_text
    assert sum(t["loss_mask"]) == t["completion_len"] and t["loss_mask"][: t["prompt_len"]] == [0] * t["prompt_len"]


# --- the wrong end-of-turn id (the original 163533 'chas' bug) -------------------------------

def test_wrong_end_of_turn_is_named_with_both_ids_and_strings(kimi_dir, kimi, tmp_path):
    base = _id(kimi, "[BOS]")
    word = "Ġchas"  # ' chas', an ordinary BPE merge in this vocabulary, as 163533 is in Kimi's
    ordinary = _id(kimi, word)
    assert ordinary < base and kimi.tokenizer.convert_ids_to_tokens(ordinary) == word
    wrong = TargetTokenizer.load(kimi_dir, end_of_turn=word, trust_remote_code=True)
    assert wrong.end_of_turn_id == ordinary
    msgs = [{"role": "user", "content": "Hi"}]
    prompt = kimi.render_prompt(msgs)
    native = row(sample_id="n", source="sglang", text="Hello", prompt_ids=prompt,
                 output_ids=kimi.retokenize_completion("Hello", "stop", prompt_ids=prompt))  # ends with <|im_end|>
    rebuilt = row(sample_id="r", text="Hello")  # rebuilt with the wrong id, so it "ends correctly"
    rows = [build_token_row(native, None, wrong), build_token_row(rebuilt, msgs, wrong)]
    path = tmp_path / "tokens.parquet"
    pl.DataFrame(rows, schema=TOKEN_SCHEMA).write_parquet(path)
    with duckdb.connect() as con:
        result = special_token_result(wrong, con, str(path))
    print(result.description)
    assert not result.passed
    eot = kimi.end_of_turn_id
    assert (f"1 stopped turns end with id {eot} ('<|im_end|>') instead of the end-of-turn string {word!r}, "
            f"which is id {ordinary}") in result.description
    assert (f"the chat template closes assistant turns with '<|im_end|>' = id {eot}, but end_of_turn is configured "
            f"as {word!r} = id {ordinary}") in result.description
    with duckdb.connect() as con:
        ok = special_token_result(kimi, con, str(_ok(kimi, tmp_path, msgs, prompt)))
    # the literal '<|im_user|>' in the re-tokenized row is reported, not blocking
    assert ok.severity == dg.AssetCheckSeverity.WARN and "1 re-tokenized rows write special-token strings" in ok.description
    assert ok.metadata["literal_special_rows"].value == 1 and ok.metadata["special_in_text"].value == 0


def _ok(kimi, tmp_path, msgs, prompt):
    rows = [build_token_row(row(sample_id="n", source="sglang", text="Hi <|im_end|>", prompt_ids=prompt,
                                output_ids=kimi.retokenize_completion("Hi <|im_end|>", "stop", prompt_ids=prompt)), None, kimi),
            build_token_row(row(sample_id="r", text="<|im_user|> literal"), msgs, kimi)]
    path = tmp_path / "ok.parquet"
    pl.DataFrame(rows, schema=TOKEN_SCHEMA).write_parquet(path)
    return path


# --- adversarial text ------------------------------------------------------------------------

SPECIAL_STRINGS = "<|im_end|> <|im_start|> <|im_user|> <|im_assistant|> <|im_middle|> [EOS] <|endoftext|>"


def test_literal_special_strings(any_tok):
    tok = any_tok
    msgs = [{"role": "user", "content": f"Say {SPECIAL_STRINGS} please"}]
    t = build_token_row(row(text=f"Sure: {SPECIAL_STRINGS}"), msgs, tok)
    completion = t["input_ids"][t["prompt_len"]:]
    # completion: encoded as the target's tokenizer encodes text. Kimi's encode allows every special
    # string (split_special_tokens has no effect on it), so each literal becomes its special id,
    # and the row says so; the text still decodes back unchanged
    literals = tok.literal_specials(SPECIAL_STRINGS)
    assert literals and t["literal_specials"] == len(literals)
    assert sum(i in tok.special_ids for i in completion[:-1]) == len(literals) and completion[-1] == tok.end_of_turn_id
    assert "literal special strings in text encoded as special ids" in t["build_notes"]
    assert tok.decode(completion[:-1]).endswith(f"Sure: {SPECIAL_STRINGS}")
    if tok is not any_tok or "kimi" in tok.source.lower():
        assert tok.tokenizer.encode("<|im_end|>", add_special_tokens=False, split_special_tokens=True) == [163586]
    # prompt: rendered as the server renders it, so the user's literal <|im_end|> IS the special id
    # (what the target was conditioned on); documented in eagle3_assets.target.tokenizer
    prompt = t["input_ids"][: t["prompt_len"]]
    plain = tok.render_prompt([{"role": "user", "content": "Say please"}])
    assert prompt.count(tok.end_of_turn_id) == plain.count(tok.end_of_turn_id) + 1
    assert prompt == tok.render_prompt(msgs)


def test_literal_think_markers_in_kimi_text_are_the_non_special_think_ids(kimi):
    # <think>/</think> are special=False added tokens in Kimi: its own encode maps them to their ids
    ids = kimi.encode_text("a <think> b </think> c")
    assert kimi.think_start_id in ids and kimi.think_end_id in ids
    assert kimi.decode(ids) == "a <think> b </think> c"


UNICODE = ["👩‍👩‍👧 family ❤️ 🚀", "机器学习很有趣。", "e\u0301 n\u0303 a\u0308\u0301 Å", "한국어 텍스트",
           "mixed: 日本語 + emoji 🎉 + café"]


@pytest.mark.parametrize("text", UNICODE)
def test_unicode_round_trips(any_tok, text):
    tok = any_tok
    ids = tok.encode_text(text)
    assert tok.decode(ids) == text
    prompt = tok.render_prompt([{"role": "user", "content": text}])
    native = tok.retokenize_completion(text, "stop", prompt_ids=prompt)
    t = build_token_row(row(text=text, prompt_ids=prompt, output_ids=native, source="sglang"), None, tok)
    assert t["retok_exact"] and tok.decode(t["input_ids"][: t["prompt_len"]]).count(text) == 1


def test_empty_completion(any_tok):
    tok = any_tok
    msgs = [{"role": "user", "content": "Say nothing."}]
    stopped = build_token_row(row(text=""), msgs, tok)
    tail = [tok.think_end_id, tok.end_of_turn_id] if tok.has_think_tokens else [tok.end_of_turn_id]
    assert stopped["input_ids"][stopped["prompt_len"]:] == tail
    cut = build_token_row(row(text=None, finish_reason="length"), msgs, tok)
    assert cut["completion_len"] == 0 and "empty completion" in cut["build_notes"]
    native = build_token_row(row(text="", prompt_ids=[1, 2], output_ids=[], finish_reason="length"), None, tok)
    assert native["retok_exact"] and native["retok_total"] == 0


def test_completion_cut_mid_utf8_is_measured_not_a_crash(any_tok):
    tok = any_tok
    for s in ["Done 🎉", "ok 👩‍👩‍👧", "機械学習", "Ångström 😀😀"]:
        ids = tok.encode_text(s)
        cut = next((k for k in range(len(ids) - 1, 0, -1) if "\ufffd" in tok.decode(ids[:k])), None)
        if cut:
            break
    assert cut, "some cut must end inside a character"
    native = ids[:cut]
    text = tok.decode(native)  # what a server returns: the partial character replaced
    t = build_token_row(row(text=text, prompt_ids=[1, 2], output_ids=native, finish_reason="length", source="sglang"), None, tok)
    assert t["input_ids"] == [1, 2] + native and not t["retok_exact"]
    assert 0 < t["retok_matched"] < t["retok_total"] and "at token" in t["retok_diff"]


def test_whitespace_only_text(any_tok):
    tok = any_tok
    for text in ["   ", "\n\n", " \t \n "]:
        ids = tok.encode_text(text)
        assert ids and tok.decode(ids) == text
        t = build_token_row(row(text=text), [{"role": "user", "content": "Spaces?"}], tok)
        assert t["input_ids"][-1] == tok.end_of_turn_id and tok.decode(t["input_ids"][t["prompt_len"]:-1]).endswith(text)


def test_prompt_longer_than_the_context(kimi, target_tokenizer):
    long_msgs = [{"role": "user", "content": "word " * 5000}]
    expected = r"sample long \(prompt 'p'\): prompt \d+ \+ completion \d+ = \d+ tokens exceeds max_length 4096"
    with pytest.raises(ContextLengthError, match=expected):
        build_token_row(row(sample_id="long", text="ok"), long_msgs, kimi)
    msgs = [{"role": "user", "content": "Hi"}]
    text = "one two three four five six seven eight nine ten"
    full = build_token_row(row(text=text), msgs, target_tokenizer)
    limit = full["prompt_len"] + 4
    with pytest.raises(ContextLengthError, match=r"sample s \(prompt .p.\): .*exceeds max_length .*set truncate"):
        build_token_row(row(text=text), msgs, target_tokenizer, max_length=limit)
    t = build_token_row(row(text=text), msgs, target_tokenizer, max_length=limit, truncate=True)
    assert len(t["input_ids"]) == limit == len(t["loss_mask"]) and t["completion_len"] == 4
    assert t["finish_reason"] == "length" and "truncated from" in t["build_notes"]
    with pytest.raises(ContextLengthError, match="prompt alone fills it"):
        build_token_row(row(text=text), msgs, target_tokenizer, max_length=full["prompt_len"], truncate=True)
    assert build_token_row(row(text=text), msgs, target_tokenizer, max_length=0)["completion_len"] == full["completion_len"]


def test_target_resource_passes_thinking_and_remote_code(kimi_dir):
    from eagle3_assets.resources import TargetResource

    res = TargetResource(tokenizer=str(kimi_dir), end_of_turn="<|im_end|>", trust_remote_code=True, thinking=False)
    tok = res.load_tokenizer()
    assert tok.thinking is False and tok.render_prompt([{"role": "user", "content": "Hi"}])[-1] == tok.think_end_id
    assert tok.template_turn_end() == ("<|im_end|>", tok.end_of_turn_id)
