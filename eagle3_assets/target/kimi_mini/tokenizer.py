"""The ``kimi-mini`` tokenizer files: a small tiktoken BPE with Kimi's ids around it.

What is Kimi's: 163,584 base ids, then the 256 special / reserved
slots at the real ids (``[BOS]`` 163584, ``[EOS]`` 163585, ``<|im_end|>`` 163586 ... ``[PAD]``
163839, unnamed slots ``<|reserved_token_{id}|>``), ``special`` false for the think and tool-call
markers, ``eos_token`` ``[EOS]`` while turns end with ``<|im_end|>``, the pre-tokenizer regex, the
encode/decode semantics (``tokenization_kimi.py``) and the chat template's rules
(``chat_template.jinja``), and K2.5's ``apply_chat_template`` override with its TypeScript tool
declaration (``tool_declaration_ts.py``). What is not: the merges. A few thousand are trained here on a bundled
text; the rest of the base range is filled with byte strings that are never valid UTF-8, so text
never reaches them (the model's rows for them are zero, see ``model.py``).
"""

from __future__ import annotations

import base64
import json
import shutil
from collections import Counter
from pathlib import Path

NUM_BASE_TOKENS = 163_584
NUM_SLOTS = 256
TRAINED_MERGES = 2_000
HERE = Path(__file__).parent
REMOTE_CODE = ("tokenization_kimi.py", "tool_declaration_ts.py")  # the tokenizer's code, loaded with trust_remote_code

# Kimi's named slots relative to the first special id, and whether each is special.
SLOTS: dict[int, tuple[str, bool]] = {
    0: ("[BOS]", True), 1: ("[EOS]", True), 2: ("<|im_end|>", True), 3: ("<|im_user|>", True),
    4: ("<|im_assistant|>", True), 6: ("<|start_header_id|>", True), 7: ("<|end_header_id|>", True),
    9: ("[EOT]", True), 10: ("<|im_system|>", True),
    11: ("<|tool_calls_section_begin|>", False), 12: ("<|tool_calls_section_end|>", False),
    13: ("<|tool_call_begin|>", False), 14: ("<|tool_call_argument_begin|>", False), 15: ("<|tool_call_end|>", False),
    17: ("<|im_middle|>", True), 18: ("<|media_begin|>", True), 19: ("<|media_content|>", True),
    20: ("<|media_end|>", True), 21: ("<|media_pad|>", True),
    22: ("<think>", False), 23: ("</think>", False),
    254: ("[UNK]", True), 255: ("[PAD]", True),
}
ADDITIONAL_SPECIAL = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>", "<|end_header_id|>",
                      "[EOT]", "<|im_system|>", "<|im_middle|>", "<|media_begin|>", "<|media_content|>",
                      "<|media_end|>", "<|media_pad|>"]


def slot_id(name: str) -> int:
    """The real Kimi id of a named slot, e.g. ``slot_id("<|im_end|>") == 163586``."""
    return NUM_BASE_TOKENS + next(k for k, (n, _) in SLOTS.items() if n == name)


def training_text() -> str:
    """The bundled text the merges are learnt from (a short multilingual sample and the demo
    prompts' text, frozen here so the tokenizer never changes with a user's prompt files)."""
    return (HERE / "bpe_corpus.txt").read_text(encoding="utf-8")


def train_ranks(text: str, merges: int = TRAINED_MERGES) -> dict[bytes, int]:
    """Byte-level BPE ranks learnt from ``text`` split by Kimi's pre-tokenizer (deterministic:
    ties go to the lexicographically smallest pair)."""
    import regex

    from eagle3_assets.target.kimi_mini.tokenization_kimi import PAT_STR

    words = Counter(regex.findall(PAT_STR, text, flags=regex.V1))
    seqs = {w: [bytes([b]) for b in w.encode("utf-8")] for w in words}
    ranks = {bytes([i]): i for i in range(256)}
    for _ in range(merges):
        pairs: Counter = Counter()
        for w, n in words.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[a, b] += n
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], [-x for x in kv[0][0] + b"\xff" + kv[0][1]]))[0]
        if pairs[best] < 2:
            break
        merged = best[0] + best[1]
        ranks[merged] = len(ranks)
        for w, s in seqs.items():
            i, out = 0, []
            while i < len(s):
                if i + 1 < len(s) and s[i] == best[0] and s[i + 1] == best[1]:
                    out.append(merged)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return ranks


def fill_ranks(ranks: dict[bytes, int], total: int = NUM_BASE_TOKENS) -> dict[bytes, int]:
    """Pad the base range to ``total`` ids with byte strings no text can produce (0xF8 never
    occurs in UTF-8), so the special slots land at Kimi's ids."""
    out = dict(ranks)
    n = len(out)
    while n < total:
        out[b"\xf8" + n.to_bytes(3, "big")] = n
        n += 1
    return out


def write_tokenizer(out_dir: Path) -> dict:
    """Write ``tiktoken.model``, the tokenizer's code, ``tokenizer_config.json`` and the chat
    template into ``out_dir``; returns facts the model builder needs."""
    out_dir = Path(out_dir)
    trained = train_ranks(training_text())
    ranks = fill_ranks(trained)
    with (out_dir / "tiktoken.model").open("wb") as fh:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            fh.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
    for module in REMOTE_CODE:
        shutil.copyfile(HERE / module, out_dir / module)
    added = {}
    for k in range(NUM_SLOTS):  # every slot is an added token, the unnamed ones as reserved specials
        name, special = SLOTS.get(k, (f"<|reserved_token_{NUM_BASE_TOKENS + k}|>", True))
        added[str(NUM_BASE_TOKENS + k)] = {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                                           "single_word": False, "special": special}
    template = (HERE / "chat_template.jinja").read_text(encoding="utf-8")
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "added_tokens_decoder": added,
        "additional_special_tokens": ADDITIONAL_SPECIAL,
        "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]",
        "model_max_length": 1_000_000_000_000_000_019_884_624_838_656,
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out_dir / "chat_template.jinja").write_text(template, encoding="utf-8")
    (out_dir / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]",
        "additional_special_tokens": ADDITIONAL_SPECIAL}, indent=2) + "\n")
    return {"trained_tokens": len(trained), "vocab_size": NUM_BASE_TOKENS + NUM_SLOTS,
            "text_ids": text_ids(trained)}


def text_ids(ranks: dict[bytes, int]) -> list[int]:
    """Base ids whose bytes are whole UTF-8 text without control characters (newline and tab
    allowed): what a chat model emits on its own, as opposed to stray bytes."""
    out = []
    for token, rank in ranks.items():
        try:
            s = token.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if all(c in "\n\t" or c.isprintable() for c in s):
            out.append(rank)
    return sorted(out)
