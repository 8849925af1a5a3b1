"""Loading a target's language model with transformers, whatever wraps it.

A multimodal checkpoint such as Kimi-K2.5 keeps its language model under ``text_config`` and its
weights under ``language_model.`` (``language_model.model.layers.N...``,
``language_model.lm_head.weight``) beside a vision tower. Every stage here needs only the
language model, so it is built from ``text_config`` and its weights are read with the prefix
mapped away; the vision weights are never loaded. A plain causal-LM checkpoint loads as it is.
"""

from __future__ import annotations

import json
from pathlib import Path

LANGUAGE_PREFIX = "language_model."


def read_config(model_dir: Path | str) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def is_wrapped(config: dict) -> bool:
    """True for a multimodal wrapper whose language model lives in ``text_config``."""
    return isinstance(config.get("text_config"), dict)


def load_causal_lm(model_dir: Path | str, *, dtype: str = "float32", device: str = "cpu",
                   trust_remote_code: bool = False):
    """The target's causal language model (transformers), in eval mode on ``device``, its weights in
    ``dtype`` (``auto`` for either: :mod:`~eagle3_assets.target.precision`)."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from eagle3_assets.target.precision import resolve_device, resolve_dtype

    model_dir = Path(model_dir)
    device = resolve_device(device)
    torch_dtype = getattr(torch, resolve_dtype(dtype, device))
    if not is_wrapped(read_config(model_dir)):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    else:
        text = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code).get_text_config(decoder=True)
        mapping = {r"^language_model\.model\.": "model.", r"^language_model\.lm_head\.": "lm_head."}
        level = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # the vision weights are left out on purpose
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, config=text, key_mapping=mapping, dtype=torch_dtype)
        finally:
            transformers.logging.set_verbosity(level)
    return model.to(device).eval()
