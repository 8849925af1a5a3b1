"""The registry of the drafter's attention architectures: kind -> where its class lives and,
for a kind shaped after the target, the function reading those sizes from the target's config.

Each class is built from the :class:`~eagle3_assets.drafter.model.DrafterConfig`, provides
``rotary(cfg)`` (the module giving cos/sin for its positions) and is called as
``attn(x, cos, sin, context)`` with one of the attention contexts of ``drafter/model.py``
(training-time test or KV cache), so training and decoding are the same for every kind.
The entries are ``"module:name"`` strings resolved on use: the model consults this registry and
the kinds' modules import only the building blocks (``drafter/norm.py``, ``drafter/rope.py``),
so no kind imports the model. A new attention kind is one entry here (and its weight names in
``drafter/export.py``'s layouts).
"""

from __future__ import annotations

import importlib

ATTENTION = {
    "llama": "eagle3_assets.drafter.model:Attention",  # GQA, the default: what every engine serves
    "mla": "eagle3_assets.drafter.mla:MLAAttention",  # DeepSeek-V3 / Kimi-K2.5's latent attention
}
# Kinds that copy sizes of the target's own attention: kind -> function(text config) -> dict.
TARGET_SHAPE = {
    "mla": "eagle3_assets.drafter.mla:mla_shape",
}


def _resolve(ref: str):
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def attention_class(kind: str):
    return _resolve(ATTENTION[kind])


def target_shape(kind: str, text: dict) -> dict | None:
    """The target's attention sizes a drafter of this kind copies (None for kinds that have none)."""
    return _resolve(TARGET_SHAPE[kind])(text) if kind in TARGET_SHAPE else None
