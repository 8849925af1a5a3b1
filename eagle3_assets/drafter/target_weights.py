"""The target's weights the drafter reuses (input embeddings, output head), read straight from its
safetensors files without building the model: at Kimi-K2.5's size the model does not fit a CPU,
but one tensor does."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle3_assets.target.config import read_config, text_config

# Where checkpoints keep the input embedding and the output head: plain causal LMs, the original
# multimodal layout (Kimi-K2.5: language_model.model.*, language_model.lm_head) and transformers'
# own multimodal layout (model.language_model.*).
EMBEDDING_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight", "language_model.model.embed_tokens.weight",
                   "model.language_model.embed_tokens.weight")
LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")
FINAL_NORM_NAMES = ("model.norm.weight", "norm.weight", "language_model.model.norm.weight",
                    "model.language_model.norm.weight")


def read_target_tensor(model_dir: Path, *names: str) -> torch.Tensor:
    """The first of ``names`` found in the target's safetensors files (sharded or not),
    read without building the model."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {n: model_dir / weight_map[n] for n in names if n in weight_map}
    else:
        files = {n: model_dir / "model.safetensors" for n in names}
    for name in names:
        if name in files:
            with safe_open(str(files[name]), framework="pt") as fh:
                if name in fh.keys():
                    return fh.get_tensor(name)
    raise KeyError(f"{model_dir}: none of {names} in the target's weights")


def read_target_embeddings(model_dir: Path) -> torch.Tensor:
    """The target's input embedding matrix [V, H] (what the drafter embeds tokens with)."""
    return read_target_tensor(model_dir, *EMBEDDING_NAMES)


def read_target_lm_head(model_dir: Path, config: dict | None = None) -> torch.Tensor:
    """The target's output head [V, H]; the embedding matrix when the target ties them (``config``: its
    ``config.json`` when already read)."""
    cfg = read_config(model_dir) if config is None else config
    text = text_config(cfg)
    if text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)):
        return read_target_embeddings(model_dir)
    return read_target_tensor(model_dir, *LM_HEAD_NAMES)


def read_target_final_norm(model_dir: Path) -> torch.Tensor:
    """The gain of the target's final RMSNorm [H] (the norm in front of its head)."""
    return read_target_tensor(model_dir, *FINAL_NORM_NAMES)
