"""The ``kimi-mini`` checkpoint: Kimi-K2.5's architecture and file layout at a size a CPU runs.

Config: K2.5's multimodal wrapper (``model_type`` ``kimi_k25``, a small vision tower) around a
DeepSeek-V3 ``text_config`` with K2.5's keys and values where size allows: MLA attention
(``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``),
routed + shared experts behind ``first_k_dense_replace`` = 1 dense layer, sigmoid ``noaux_tc``
routing with ``routed_scaling_factor`` 2.827, K2.5's yarn ``rope_scaling`` (factor 64 over 4,096
original positions, theta 50,000), ``max_position_embeddings`` 262,144, ``vocab_size`` 163,840,
``eos_token_id`` 163585 (``[EOS]``, as K2.5's config says; its turns end with ``<|im_end|>`` 163586, which
every decode loop adds to its stop ids), ``num_nextn_predict_layers`` 0. Sizes are cut: 7 layers
(the fewest for which EAGLE-3's default aux layers [1, L//2-1, L-4] are distinct), hidden 64.

Weights: written as K2.5 stores them, under ``language_model.`` (``language_model.model.layers.N``,
per-expert ``mlp.experts.E.*``, ``language_model.lm_head.weight``) next to ``vision_tower.`` and
``mm_projector.``; float32, not K2.5's int4 experts. Initialisation is random and seeded; three
deliberate edits make a random model behave like a chat model at the token level: the rows of
ids no text reaches (the tokenizer's filler range) are zero in the embedding; in the head only
whole-text tokens and ``</think>`` / ``<|im_end|>`` keep nonzero rows (stray bytes and unused
special slots are never the likeliest token), scaled so sampling stays on them; and the rows of
``</think>`` and ``<|im_end|>`` are scaled up so replies close their think block and end their turn.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_assets.target.kimi_mini.tokenizer import NUM_BASE_TOKENS, NUM_SLOTS, slot_id

SEED = 20260
HEAD_SCALE = 24.0  # text rows of lm_head: logits spread wide enough that filler ids never win a sample
TURN_SCALES = {"</think>": 1.8, "<|im_end|>": 1.7}  # relative to the text rows

TEXT_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "vocab_size": NUM_BASE_TOKENS + NUM_SLOTS,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 7,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    # MLA latent at K2.5's own size: 512 + 64 = 576 is the only latent vLLM's CPU MLA decode
    # kernel is built for (with smaller dims vLLM loads the model, then fails every request)
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 64,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "max_position_embeddings": 262144,
    "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "num_nextn_predict_layers": 0,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "bos_token_id": slot_id("[BOS]"),
    "eos_token_id": slot_id("[EOS]"),  # K2.5: 163585; a turn ends with <|im_end|> 163586
    "pad_token_id": slot_id("[PAD]"),
    "dtype": "float32",
}

VISION_CONFIG = {"model_type": "kimi_k25_vision", "patch_size": 14, "pos_emb_height": 4, "pos_emb_width": 4,
                 "pos_emb_time": 2, "num_attention_heads": 2, "num_hidden_layers": 1, "hidden_size": 16,
                 "intermediate_size": 32, "merge_kernel_size": [2, 2]}


def vision_config() -> dict:
    """The vision tower under both spellings engines read: transformers' (``hidden_size``,
    ``pos_emb_height``, ...; vLLM reads the same config class) and K2.5's release keys, which
    SGLang's ``KimiK25ForConditionalGeneration`` reads (``vt_hidden_size`` and ``text_hidden_size`` in
    its projector, ``init_pos_emb_*``, ``pos_emb_type``, ``merge_type``, ``video_attn_type`` in its
    tower). Without the second set SGLang cannot build the model, even to serve text."""
    v = dict(VISION_CONFIG)
    return {**v,
            "init_pos_emb_height": v["pos_emb_height"], "init_pos_emb_width": v["pos_emb_width"],
            "init_pos_emb_time": v["pos_emb_time"], "pos_emb_type": "divided_fixed",
            "video_attn_type": "spatial_temporal", "merge_type": "sd2_tpool",
            "vt_hidden_size": v["hidden_size"], "vt_num_attention_heads": v["num_attention_heads"],
            "vt_num_hidden_layers": v["num_hidden_layers"], "vt_intermediate_size": v["intermediate_size"],
            "mm_hidden_size": v["hidden_size"], "mm_projector_type": "patchmerger",
            "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05,
            "text_hidden_size": TEXT_CONFIG["hidden_size"]}


def model_config() -> dict:
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": dict(TEXT_CONFIG),
        "vision_config": vision_config(),
        "projection_hidden_size": 16,
        "bos_token_id": slot_id("[BOS]"),
        "eos_token_id": slot_id("[EOS]"),  # K2.5: 163585; a turn ends with <|im_end|> 163586
        "pad_token_id": slot_id("[PAD]"),
        "media_placeholder_token_id": slot_id("<|media_pad|>"),
        "image_token_id": slot_id("<|media_pad|>"),
        "tie_word_embeddings": False,
        "dtype": "float32",
    }


def build_weights(config_path: Path, text_ids: list[int]) -> dict:
    """Seeded weights in the checkpoint's own names (see the module docstring)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    cfg = AutoConfig.from_pretrained(str(config_path.parent))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32)
    lm = model.model.language_model
    with torch.no_grad():
        head, emb = model.lm_head.weight, lm.embed_tokens.weight
        emitted = torch.zeros(head.shape[0], dtype=torch.bool)
        emitted[text_ids] = True
        for name in TURN_SCALES:
            emitted[slot_id(name)] = True
        head.mul_(HEAD_SCALE)
        head[~emitted] = 0.0  # stray bytes, fillers and unused slots: never the likeliest token
        for name, scale in TURN_SCALES.items():
            head[slot_id(name)] *= scale
        emb[max(text_ids) + 1:NUM_BASE_TOKENS] = 0.0  # filler ids: no text ever reaches them
    sd = _checkpoint_names(model)
    return {k: v.detach().contiguous() for k, v in sd.items()}


# transformers' reverse mapping -> K2.5's own names (the ones vLLM's KimiK25ForConditionalGeneration loads)
CHECKPOINT_RENAMES = {"language_model.model.blocks.": "language_model.model.layers.",
                      "model.mm_projector.": "mm_projector.",
                      "vision_tower.encoder.patch_embed.": "vision_tower.patch_embed."}


def _checkpoint_names(model) -> dict:
    """The state dict under the names the original checkpoint format uses (transformers' own
    reverse mapping gets three prefixes wrong, see ``CHECKPOINT_RENAMES``)."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        sd = load_file(str(Path(tmp) / "model.safetensors"))
    out = {}
    for k, v in sd.items():
        for old, new in CHECKPOINT_RENAMES.items():
            if k.startswith(old):
                k = new + k[len(old):]
        out[k] = v
    return out


def write_model(out_dir: Path, text_ids: list[int]) -> None:
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    config = model_config()
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps({
        "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"], "do_sample": False}, indent=2) + "\n")
    save_file(build_weights(out_dir / "config.json", text_ids), str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
