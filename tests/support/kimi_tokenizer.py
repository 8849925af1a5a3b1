"""The ``kimi-mini`` tokenizer alone, for tests that need Kimi's tokenizer but not the model.

The tokenizer itself (Kimi's ids, encode/decode semantics and chat template) is the ``kimi-mini``
target's: ``eagle3_assets.target.kimi_mini``. This writes only its tokenizer files (a few seconds,
no weights) plus a small ``config.json`` whose 4,096-token context lets tests reach the limit.
Load it with ``trust_remote_code=True``, as a Kimi checkpoint's tokenizer is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_assets.target.kimi_mini.tokenizer import NUM_BASE_TOKENS, SLOTS, slot_id, write_tokenizer

KIMI_SLOTS = SLOTS
TEST_CONTEXT = 4096


def build_kimi_test_tokenizer(out_dir: Path | str) -> Path:
    """Write the kimi-mini tokenizer to ``out_dir`` with a 4,096-token ``config.json``; return it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out)
    (out / "config.json").write_text(json.dumps({
        "max_position_embeddings": TEST_CONTEXT, "eos_token_id": slot_id("[EOS]"),
        "bos_token_id": NUM_BASE_TOKENS}) + "\n")
    return out
