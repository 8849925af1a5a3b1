"""The ids a generation of the target ends on: every eos it declares, and the end of its turns.

A chat model's turn ends with its template's end-of-turn token, which need not be its
``eos_token_id``: Kimi-K2.5's config says ``[EOS]`` (163585) while every turn ends with
``<|im_end|>`` (163586). A decode loop that stops on ``eos_token_id`` alone would run past the
end of every K2.5 turn, so every loop here (local generation, the drafter's evaluation, the vLLM
acceptance run, requests to SGLang and vLLM) stops on this whole set.
"""

from __future__ import annotations

import json
from pathlib import Path


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def decode_stop_ids(model_dir: Path | str, tokenizer=None) -> list[int]:
    """``eos_token_id`` of ``config.json`` (and its ``text_config``) and ``generation_config.json``,
    then the tokenizer's eos and end of turn (``tokenizer``: a ``TargetTokenizer``), in that order."""
    found: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        data = json.loads(path.read_text()) if path.is_file() else {}
        for part in (data, data.get("text_config") or {}):
            found += _ids(part.get("eos_token_id"))
    if tokenizer is not None:
        found += _ids(tokenizer.tokenizer.eos_token_id) + [int(tokenizer.end_of_turn_id)]
    return list(dict.fromkeys(found))
