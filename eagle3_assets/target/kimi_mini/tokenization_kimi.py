"""Kimi's tokenizer semantics on a tiktoken BPE: the remote-code module of the ``kimi-mini`` target.

The builder copies this file into the target's directory and names it in ``tokenizer_config.json``
(``auto_map``), so ``AutoTokenizer.from_pretrained(dir, trust_remote_code=True)`` loads it the way
a Kimi-K2.5 checkpoint's ``tokenization_kimi.py`` is loaded. It is self-contained (tiktoken and
transformers only) and follows the documented behaviour of Kimi's ``TikTokenTokenizer``:

- ids ``0..n-1`` are the BPE ranks in ``tiktoken.model``; the 256 ids after them are the special /
  reserved slots, named by ``added_tokens_decoder`` or ``<|reserved_token_{id}|>``;
- ``encode(text)`` allows every special string: a literal ``<|im_end|>`` in the text becomes its id.
  Because ``_tokenize`` goes through that same ``encode``, ``split_special_tokens=True`` changes
  nothing, exactly as with the real tokenizer;
- ``encode`` with keyword arguments falls back to the Hugging Face path (which also ends in
  ``_tokenize``); no BOS is ever added;
- ``decode(ids)`` without keyword arguments is tiktoken's raw decode; with them it is Hugging
  Face's ``_decode`` over byte-level tokens, joined with ``errors="replace"``;
- ``apply_chat_template`` is overridden as K2.5 overrides it: ``tokenize=False`` and
  ``add_generation_prompt=True`` by default, the tool dicts deep-sorted, and the tools written as a
  TypeScript namespace (``tool_declaration_ts.py``, shipped beside this file) handed to the
  template as ``tools_ts_str``; when that encoder cannot read a schema the template prints the
  tools as compact JSON instead.
"""

from __future__ import annotations

import base64
import logging
import os
from shutil import copyfile

import tiktoken
from transformers import PreTrainedTokenizer

from .tool_declaration_ts import encode_tools_to_typescript_style

logger = logging.getLogger(__name__)

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}
NUM_SPECIAL_SLOTS = 256
MAX_CHARS = 400_000  # one tiktoken call at most
MAX_RUN = 25_000  # longest run of (non-)whitespace handed to the regex at once
PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


def bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet: printable bytes stand for themselves, the rest shift past 255."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), 256))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def read_ranks(path: str) -> dict[bytes, int]:
    """``tiktoken.model``: one ``base64(token) rank`` pair per line."""
    ranks = {}
    with open(path, "rb") as fh:
        for line in fh:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def deep_sort(value):
    """Dicts with their keys sorted, at every depth (list order kept)."""
    if isinstance(value, dict):
        return {k: deep_sort(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [deep_sort(v) for v in value]
    return value


def _split_runs(text: str, limit: int):
    """Pieces of ``text`` in which no run of whitespace or of non-whitespace exceeds ``limit``."""
    start, run, kind = 0, 0, None
    for i, ch in enumerate(text):
        space = ch.isspace()
        run = run + 1 if space == kind else 1
        kind = space
        if run > limit:
            yield text[start:i]
            start, run = i, 1
    yield text[start:]


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token="[UNK]", pad_token="[PAD]",
                 additional_special_tokens=None, added_tokens_decoder=None, **kwargs):
        self.vocab_file = vocab_file
        ranks = read_ranks(vocab_file)
        self.num_base_tokens = len(ranks)
        named = {int(i): (t.content if hasattr(t, "content") else str(t["content"] if isinstance(t, dict) else t))
                 for i, t in (added_tokens_decoder or {}).items()}
        self.special_tokens = {named.get(i, f"<|reserved_token_{i}|>"): i
                               for i in range(self.num_base_tokens, self.num_base_tokens + NUM_SPECIAL_SLOTS)}
        self.model = tiktoken.Encoding(name=os.path.basename(vocab_file), pat_str=PAT_STR,
                                       mergeable_ranks=ranks, special_tokens=self.special_tokens)
        byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in byte_encoder.items()}
        self.decoder = {rank: "".join(byte_encoder[b] for b in token) for token, rank in ranks.items()}
        self.decoder.update({i: name for name, i in self.special_tokens.items()})
        self.encoder = {v: k for k, v in self.decoder.items()}
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         additional_special_tokens=additional_special_tokens,
                         added_tokens_decoder=added_tokens_decoder, **kwargs)

    # -- the vocabulary

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.encoder)

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder.get(token, self.encoder[self.unk_token])

    def _convert_id_to_token(self, index: int) -> str:
        return self.decoder.get(index, self.unk_token)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        out = bytearray()
        for t in tokens:
            if t in self.special_tokens:
                out += t.encode("utf-8")
            else:
                out += bytes(self.byte_decoder[c] for c in t)
        return out.decode("utf-8", errors="replace")

    # -- encoding and decoding

    def encode(self, text, allow_special_tokens: bool = True, **kwargs):
        if kwargs:  # the Hugging Face path (add_special_tokens, split_special_tokens, ...)
            return super().encode(text, **kwargs)
        allowed = "all" if allow_special_tokens else set()
        ids: list[int] = []
        for i in range(0, len(text), MAX_CHARS):
            for piece in _split_runs(text[i:i + MAX_CHARS], MAX_RUN):
                ids += self.model.encode(piece, allowed_special=allowed, disallowed_special=())
        return ids

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return [self.decoder[t] for t in self.encode(text)]

    def decode(self, token_ids, **kwargs) -> str:
        if kwargs or not isinstance(token_ids, (list, tuple)) or (token_ids and not isinstance(token_ids[0], int)):
            return super().decode(token_ids, **kwargs)
        return self.model.decode(list(token_ids))

    # -- chat template

    def apply_chat_template(self, conversation, tools=None, tokenize=False, add_generation_prompt=True, **kwargs):
        tools = deep_sort(tools)
        if tools and "tools_ts_str" not in kwargs:
            try:
                kwargs["tools_ts_str"] = encode_tools_to_typescript_style(tools)
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                logger.warning("tools kept as JSON: the TypeScript declaration failed (%s)", e)
        return super().apply_chat_template(conversation, tools=tools, tokenize=tokenize,
                                           add_generation_prompt=add_generation_prompt, **kwargs)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        out = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + "tiktoken.model")
        if os.path.abspath(self.vocab_file) != os.path.abspath(out):
            copyfile(self.vocab_file, out)
        return (out,)
