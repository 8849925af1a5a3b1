"""The Llama-style drafter for SGLang (``--speculative-algorithm EAGLE3 --speculative-draft-model-path
<dir>``), in the layout of its ``LlamaForCausalLMEagle3`` (``models/llama_eagle3.py``):

- ``config.json``: architectures ``["LlamaForCausalLMEagle3"]``, ``model_type`` llama, one
  hidden layer, the target's ``vocab_size`` and ``max_position_embeddings``, ``draft_vocab_size``,
  legacy ``rope_theta``/``rope_scaling`` (SGLang reads those) and an equal ``rope_parameters``
  (transformers 5), with the target's yarn scaling in the keys every reader agrees on
  (``drafter/rope.py``), ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SGLang's numbering,
  the project's "output of layer k"; the target reads them from here to know what to capture), the
  EAGLE 3.1 switches ``fc_norm`` and ``norm_output`` (always written, on or off), ``torch_dtype``;
- ``model.safetensors``: ``fc.weight`` (and ``fc_norm.{0,1,2}.weight`` with ``fc_norm``),
  ``midlayer.*``, ``norm.weight``, ``lm_head.weight`` in ``torch_dtype``, ``d2t`` int64, ``t2d``
  bool, and no ``embed_tokens`` (SGLang uses the target's).

What it will not serve as trained: ``norm_before_fc`` (it runs ``fc`` on the raw features and has
no ``input_norm.weight``: it would load the export and silently run another network). It reads
both EAGLE 3.1 switches (``fc_norm`` also under its older name ``use_aux_norm``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle3_assets.drafter.export_files import (
    DTYPES,
    SWITCH_KEYS,
    export_weights,
    rebuild_drafter,
    switch_fields,
    switch_problems,
    switches_from_config,
    write_dir_atomic,
)
from eagle3_assets.drafter.formats import ServingFormat
from eagle3_assets.drafter.formats.llama_layout import config_from_llama, llama_fields, shared_problems
from eagle3_assets.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3_assets.engines import engine_role

ENGINE = "sglang"
SGLANG_ARCH = "LlamaForCausalLMEagle3"
SGLANG_REQUIRED = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")
SGLANG_CONFIG_KEYS = ("architectures", "draft_vocab_size", "vocab_size", "hidden_size", "max_position_embeddings",
                      "num_attention_heads", "num_key_value_heads", "rope_theta", "eagle_config")
# EAGLE 3.1 switch -> the module of the pinned release that reads it for this kind (tests/integration
# check each against the installed engine)
SWITCH_READERS = {key: "sglang.srt.models.llama_eagle3" for key in SWITCH_KEYS}


def sglang_config(cfg: DrafterConfig, dtype: str = "bfloat16") -> dict:
    return {
        "architectures": [SGLANG_ARCH],
        **llama_fields(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": engine_role("serve", ENGINE).layer_ids(cfg.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
        **switch_fields(cfg),
        "torch_dtype": dtype,
    }


def export_sglang_files(model: Eagle3Drafter, out_dir: Path, *, dtype: str = "bfloat16", **_speculators) -> Path:
    """``config.json`` + ``model.safetensors`` in SGLang's ``LlamaForCausalLMEagle3`` layout."""
    if model.config.norm_before_fc:
        raise ValueError("SGLang cannot serve a drafter with norm_before_fc (see drafter/formats/llama_sglang.py); "
                         "export it for vLLM")
    weights = export_weights(model, DTYPES[dtype])
    missing = [k for k in SGLANG_REQUIRED if k not in weights]
    if missing or any(k.startswith("embed_tokens") for k in weights):
        raise ValueError(f"SGLang export would be wrong: missing {missing} or carries the embedding")
    return write_dir_atomic(out_dir, {"config.json": sglang_config(model.config, dtype), "model.safetensors": weights})


def load_sglang_files(export_dir: Path, embeddings: torch.Tensor) -> Eagle3Drafter:
    """Rebuild the drafter from an SGLang export plus the target's embedding matrix."""
    from safetensors.torch import load_file

    export_dir = Path(export_dir)
    c = json.loads((export_dir / "config.json").read_text())
    if c.get("architectures") != [SGLANG_ARCH] or c.get("num_hidden_layers") != 1:
        raise ValueError(f"{export_dir}: not a one-layer {SGLANG_ARCH} export")
    cfg = config_from_llama(c, c["draft_vocab_size"], c.get("target_hidden_size") or c["hidden_size"],
                            engine_role("serve", ENGINE).trained_ids(c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
                            **switches_from_config(c, aux_norm_alias=True))
    return rebuild_drafter(cfg, load_file(str(export_dir / "model.safetensors")), embeddings)


def aux_ids(c: dict):
    return (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")


def sglang_file_problems(export_dir: Path) -> list[str]:
    from safetensors import safe_open

    export_dir = Path(export_dir)
    cfg_path, weights_path = export_dir / "config.json", export_dir / "model.safetensors"
    if not cfg_path.exists() or not weights_path.exists():
        return [f"{export_dir}: config.json or model.safetensors is missing"]
    cfg = json.loads(cfg_path.read_text())
    problems = [f"config.json lacks {k!r}" for k in SGLANG_CONFIG_KEYS if k not in cfg]
    if cfg.get("architectures") != ["LlamaForCausalLMEagle3"]:
        problems.append(f"architectures is {cfg.get('architectures')}, not ['LlamaForCausalLMEagle3']")
    if not (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"):
        problems.append("eagle_config.eagle_aux_hidden_state_layer_ids is missing")
    with safe_open(str(weights_path), framework="pt") as f:
        names = set(f.keys())
        dtypes = {k: f.get_slice(k).get_dtype() for k in ("d2t", "t2d") if k in names}
        shapes = {k: f.get_slice(k).get_shape() for k in ("lm_head.weight", "d2t", "t2d") if k in names}
    for need in ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"):
        if need not in names:
            problems.append(f"model.safetensors lacks {need}")
    if not any(n.startswith("midlayer.") for n in names):
        problems.append("model.safetensors has no midlayer.* weights")
    if any("embed_tokens" in n for n in names):
        problems.append("model.safetensors holds embed_tokens (SGLang takes the target's)")
    if "input_norm.weight" in names:
        problems.append("model.safetensors holds input_norm (norm_before_fc), which SGLang never applies")
    problems += switch_problems(cfg, names, aux_norm_alias=True)
    if dtypes.get("d2t") not in (None, "I64"):
        problems.append(f"d2t is {dtypes['d2t']}, not int64")
    if dtypes.get("t2d") not in (None, "BOOL"):
        problems.append(f"t2d is {dtypes['t2d']}, not bool")
    if "lm_head.weight" in shapes and shapes["lm_head.weight"][0] != cfg.get("draft_vocab_size"):
        problems.append(f"lm_head rows {shapes['lm_head.weight'][0]} != draft_vocab_size {cfg.get('draft_vocab_size')}")
    if "t2d" in shapes and shapes["t2d"][0] != cfg.get("vocab_size"):
        problems.append(f"t2d length {shapes['t2d'][0]} != vocab_size {cfg.get('vocab_size')}")
    problems += shared_problems(cfg, cfg, aux_ids(cfg), "config.json", engine_role("serve", ENGINE))
    return problems


def refuses(shape) -> dict[str, str]:
    if shape.norm_before_fc:
        return {"norm_before_fc": "cannot be served by sglang: SGLang's LlamaForCausalLMEagle3 has no norm before fc "
                                  "and would run fc on the raw features; set engines = [\"vllm\"] to export this "
                                  "drafter for vLLM alone"}
    return {}


FORMAT = ServingFormat(
    kind="llama",
    engine=ENGINE,
    export=export_sglang_files,
    load=load_sglang_files,
    check=sglang_file_problems,
    recognises=lambda config: config.get("architectures") == [SGLANG_ARCH],
    aux_ids=aux_ids,
    switch_readers=SWITCH_READERS,
    refuses=refuses,
)
