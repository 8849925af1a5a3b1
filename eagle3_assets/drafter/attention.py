"""Where the drafter's attention varies: kind -> ``"module:class"``.

Each class is built from the :class:`~eagle3_assets.drafter.model.DrafterConfig`, provides
``rotary(cfg)`` (the module giving cos/sin for its positions) and is called as
``attn(x, cos, sin, context)`` with one of the attention contexts of ``drafter/model.py``
(training-time test or KV cache), so training and decoding are the same for every kind.
"""

from __future__ import annotations

import importlib

ATTENTION = {
    "llama": "eagle3_assets.drafter.model:Attention",  # GQA, the default: what every engine serves
    "mla": "eagle3_assets.drafter.mla:MLAAttention",  # DeepSeek-V3 / Kimi-K2.5's latent attention
}


def attention_class(kind: str):
    module, _, name = ATTENTION[kind].partition(":")
    return getattr(importlib.import_module(module), name)
