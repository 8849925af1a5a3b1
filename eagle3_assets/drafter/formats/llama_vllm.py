"""The Llama-style drafter for vLLM (``vllm serve <dir>`` pairs it with the verifier): a speculators
``Eagle3Speculator`` checkpoint, as vLLM 0.32 reads it (``model_executor/models/llama_eagle3.py`` +
``transformers_utils/configs/speculators/algos.py``).

Its config (``speculators_model_type`` eagle3, ``transformer_layer_config``, ``speculators_config``)
writes ``eagle_aux_hidden_state_layer_ids`` in vLLM's numbering (the project's id + 1, its serve
role's ``layer_ids``) and says every speculators-only option outright: ``norm_before_residual``
off (vLLM defaults it *on*, which would run a different network than was trained),
``norm_before_fc`` on when the drafter has that norm (one RMSNorm, ``input_norm.weight``, over the
concatenated [3H] features before ``fc``), ``fc_norm`` and ``norm_output`` as trained (vLLM's
``update_eagle3`` copies them to the draft's config; ``fc_norm.{i}.weight`` apply after
``input_norm`` when both are on). Weights are named ``layers.0.*``, with the frozen
``embed_tokens.weight`` included, as speculators checkpoints carry it.

More than one decoder layer is not written: vLLM carries the residual stream into extra layers
where SGLang feeds them the MLP output alone, so no trained network would be served the same by both.
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

ENGINE = "vllm"
SPECULATORS_ARCH = "Eagle3Speculator"
SPECULATORS_VERSION = "0.4.0"
OFF_VLLM_FLAGS = ("norm_before_residual",)  # speculators options this drafter never has (vLLM's default: on)
# EAGLE 3.1 switch -> the module of the pinned release that reads it for this kind
SWITCH_READERS = {key: "vllm.model_executor.models.llama_eagle3" for key in SWITCH_KEYS}


def _to_speculators_name(k: str) -> str:
    return "layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k


def _from_speculators_name(k: str) -> str:
    return "midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k


def vllm_config(cfg: DrafterConfig, *, dtype: str, verifier: str, verifier_architectures: list[str],
                speculative_tokens: int) -> dict:
    return {
        "architectures": [SPECULATORS_ARCH],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": {**llama_fields(cfg), "architectures": ["LlamaForCausalLM"]},
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": engine_role("serve", ENGINE).layer_ids(cfg.aux_layer_ids),
        # The SGLang-layout network: residual from the raw hidden; the optional norms as trained.
        "norm_before_residual": False,
        "norm_before_fc": bool(cfg.norm_before_fc),
        **switch_fields(cfg),
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{
                "proposal_type": "greedy",
                "speculative_tokens": speculative_tokens,
                "accept_tolerance": 0.0,
                "verifier_accept_k": 1,
            }],
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures},
        },
        "torch_dtype": dtype,
    }


def export_vllm_files(model: Eagle3Drafter, out_dir: Path, *, dtype: str = "bfloat16", verifier: str = "",
                      verifier_architectures: list[str] | None = None, speculative_tokens: int = 3) -> Path:
    """A speculators-format EAGLE-3 checkpoint for vLLM."""
    if verifier and not verifier_architectures and (Path(verifier) / "config.json").exists():
        verifier_architectures = json.loads((Path(verifier) / "config.json").read_text()).get("architectures")
    cfg = vllm_config(model.config, dtype=dtype, verifier=verifier,
                      verifier_architectures=list(verifier_architectures or []), speculative_tokens=speculative_tokens)
    weights = export_weights(model, DTYPES[dtype], rename=_to_speculators_name, embeddings=True)
    return write_dir_atomic(out_dir, {"config.json": cfg, "model.safetensors": weights})


def load_vllm_files(export_dir: Path, embeddings: torch.Tensor | None = None) -> Eagle3Drafter:
    """Rebuild the drafter from a speculators export; its own embedding unless one is given."""
    from safetensors.torch import load_file

    export_dir = Path(export_dir)
    c = json.loads((export_dir / "config.json").read_text())
    if c.get("speculators_model_type") != "eagle3":
        raise ValueError(f"{export_dir}: not a speculators eagle3 checkpoint")
    for flag in OFF_VLLM_FLAGS:
        if c.get(flag, True):  # vLLM's default is True
            raise ValueError(f"{export_dir}: {flag} is on; this drafter has no such norm")
    layer = c["transformer_layer_config"]
    cfg = config_from_llama(layer, c["draft_vocab_size"], c.get("target_hidden_size") or layer["hidden_size"],
                            engine_role("serve", ENGINE).trained_ids(c["eagle_aux_hidden_state_layer_ids"]),
                            norm_before_fc=bool(c.get("norm_before_fc", False)), **switches_from_config(c))
    weights = {_from_speculators_name(k): v for k, v in load_file(str(export_dir / "model.safetensors")).items()}
    emb = weights.pop("embed_tokens.weight", None)
    if embeddings is None:
        if emb is None:
            raise ValueError(f"{export_dir}: no embed_tokens.weight; pass the target's embeddings")
        embeddings = emb
    return rebuild_drafter(cfg, weights, embeddings)


def vllm_file_problems(export_dir: Path) -> list[str]:
    from safetensors import safe_open

    export_dir = Path(export_dir)
    cfg_path, weights_path = export_dir / "config.json", export_dir / "model.safetensors"
    if not cfg_path.exists() or not weights_path.exists():
        return [f"{export_dir}: config.json or model.safetensors is missing"]
    cfg = json.loads(cfg_path.read_text())
    problems = []
    if cfg.get("speculators_model_type") != "eagle3":
        problems.append(f"speculators_model_type is {cfg.get('speculators_model_type')!r}, not 'eagle3'")
    for flag in OFF_VLLM_FLAGS:
        if cfg.get(flag, True):
            problems.append(f"{flag} is on (or missing, and vLLM's default is on); this drafter has no such norm")
    layer = cfg.get("transformer_layer_config") or {}
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or []
    if not ids:
        problems.append("eagle_aux_hidden_state_layer_ids is missing")
    with safe_open(str(weights_path), framework="pt") as f:
        names = set(f.keys())
    for need in ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight"):
        if need not in names:
            problems.append(f"model.safetensors lacks {need}")
    if not any(n.startswith("layers.0.") for n in names):
        problems.append("model.safetensors has no layers.0.* weights")
    if bool(cfg.get("norm_before_fc", False)) != ("input_norm.weight" in names):
        problems.append(f"norm_before_fc is {bool(cfg.get('norm_before_fc', False))} but input_norm.weight is "
                        f"{'present' if 'input_norm.weight' in names else 'missing'}")
    problems += switch_problems(cfg, names)
    return problems + shared_problems(layer, cfg, ids, "transformer_layer_config", engine_role("serve", ENGINE))


def target_notes(target_config: dict) -> list[str]:
    """What vLLM will not serve of a Llama-style drafter next to this target."""
    from eagle3_assets.engines.versions import target_family
    from eagle3_assets.engines.vllm.versions import CPU_BLOCK_ERROR

    if target_family(target_config) is None:
        return []
    return ["Llama-style drafter on an MLA target: SGLang (>= 0.5.10) and vLLM GPU builds (>= 0.18.0) serve it, "
            f"vLLM's CPU build does not ('{CPU_BLOCK_ERROR}'); attention = \"mla\" serves on all three"]


FORMAT = ServingFormat(
    kind="llama",
    engine=ENGINE,
    export=export_vllm_files,
    load=load_vllm_files,
    check=vllm_file_problems,
    recognises=lambda config: config.get("speculators_model_type") == "eagle3",
    aux_ids=lambda config: config.get("eagle_aux_hidden_state_layer_ids",
                                      (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")),
    switch_readers=SWITCH_READERS,
    target_notes=target_notes,
)
