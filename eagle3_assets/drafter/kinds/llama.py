"""The Llama-style drafter (``attention = "llama"``, the default): GQA attention (``drafter/model.py``'s
``Attention``), its serving exports, the loaders that rebuild it from those files alone, and the
recipe layouts an engine would not run as trained.

SGLang (``--speculative-algorithm EAGLE3 --speculative-draft-model-path <dir>``), the layout of
``LlamaForCausalLMEagle3``:

- ``config.json``: architectures ``["LlamaForCausalLMEagle3"]``, ``model_type`` llama, one
  hidden layer, the target's ``vocab_size`` and ``max_position_embeddings``, ``draft_vocab_size``,
  legacy ``rope_theta``/``rope_scaling`` (SGLang reads those) and an equal ``rope_parameters``
  (transformers 5, vLLM), with the target's yarn scaling in the keys every reader agrees on
  (``drafter/rope.py``),
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SGLang's "output of layer k" ids; the
  target reads them from here to know what to capture), the EAGLE 3.1 switches ``fc_norm`` and
  ``norm_output`` (always written, on or off), ``torch_dtype``;
- ``model.safetensors``: ``fc.weight`` (and ``fc_norm.{0,1,2}.weight`` with ``fc_norm``), ``midlayer.*``,
  ``norm.weight``, ``lm_head.weight`` in
  ``torch_dtype``, ``d2t`` int64, ``t2d`` bool, and no ``embed_tokens`` (SGLang uses the
  target's).

vLLM / speculators (``vllm serve <dir>`` pairs it with the verifier): a speculators config
(``speculators_model_type`` eagle3, ``transformer_layer_config``, ``speculators_config``) whose
``eagle_aux_hidden_state_layer_ids`` use vLLM's numbering (our id + 1), every speculators-only
option said outright (``norm_before_residual`` off: vLLM defaults it *on*, which would run a
different network than was trained; ``norm_before_fc`` on when the drafter has that norm,
``input_norm.weight``, vLLM only, see ``UNSERVED``; ``fc_norm`` and ``norm_output`` as trained),
and weights named ``layers.0.*`` with the frozen ``embed_tokens.weight`` included, as speculators
checkpoints carry it.

Which engine runs which layout exactly as it was trained, read from the engines' EAGLE-3 Llama
drafters (SGLang ``models/llama_eagle3.py``, vLLM 0.32 ``model_executor/models/llama_eagle3.py`` +
``transformers_utils/configs/speculators/algos.py``):

- ``norm_before_fc``: vLLM reads ``norm_before_fc`` from a speculators config and applies one
  RMSNorm (``input_norm.weight``) over the concatenated [3H] features before ``fc``. SGLang's
  ``LlamaForCausalLMEagle3`` runs ``fc`` on the raw features and has no such weight: it would
  load the export and silently run another network.
- ``fc_norm`` (EAGLE 3.1): both engines read ``fc_norm`` from the draft's config (vLLM's
  ``update_eagle3`` copies it from a speculators config) and apply ``fc_norm.{i}.weight`` to aux
  layer i's H-wide slice before ``fc`` (after ``input_norm`` when both are on, vLLM). Served by both.
- ``norm_output`` (EAGLE 3.1): both engines' draft forward returns the final ``norm``'s output as
  the hidden state the next draft position reads, instead of the pre-norm residual. Served by both.
- more than one decoder layer: both engines build extra layers, but differently (vLLM carries
  the residual stream into them, SGLang feeds them the MLP output alone), so no trained network
  is served the same by both; this trainer builds one layer.

A recipe lists the engines its exports are for (``engines``, both by default); a layout one of
them would run differently is refused when the recipe is loaded.
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
    unread_switches,
    write_dir_atomic,
)
from eagle3_assets.drafter.kinds import DrafterKind
from eagle3_assets.drafter.model import Attention, DrafterConfig, Eagle3Drafter
from eagle3_assets.drafter.rope import export_rope_problems, rope_fields

SGLANG_ARCH = "LlamaForCausalLMEagle3"
SPECULATORS_ARCH = "Eagle3Speculator"
SPECULATORS_VERSION = "0.4.0"
SGLANG_REQUIRED = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")
OFF_VLLM_FLAGS = ("norm_before_residual",)  # speculators options this drafter never has (vLLM's default: on)


# ----------------------------------------------------------------------------- helpers


def _llama_fields(cfg: DrafterConfig) -> dict:
    """The Llama config fields both serving engines read for the one draft layer."""
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        **rope_fields(cfg.rope_theta, cfg.rope_scaling),
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }


def _config_from_llama(llama: dict, draft_vocab_size: int, target_hidden_size: int, aux_ids: list[int],
                       **switches: bool) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=llama["hidden_size"], intermediate_size=llama["intermediate_size"],
        num_attention_heads=llama["num_attention_heads"], num_key_value_heads=llama["num_key_value_heads"],
        head_dim=llama.get("head_dim") or llama["hidden_size"] // llama["num_attention_heads"],
        rms_norm_eps=llama["rms_norm_eps"], rope_theta=llama["rope_theta"],
        max_position_embeddings=llama["max_position_embeddings"], vocab_size=llama["vocab_size"],
        draft_vocab_size=draft_vocab_size, target_hidden_size=target_hidden_size,
        aux_layer_ids=list(aux_ids), rope_scaling=llama.get("rope_scaling"),
        hidden_act=llama.get("hidden_act", "silu"), **switches,
    )


# ----------------------------------------------------------------------------- SGLang


def sglang_config(cfg: DrafterConfig, dtype: str = "bfloat16") -> dict:
    return {
        "architectures": [SGLANG_ARCH],
        **_llama_fields(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
        **switch_fields(cfg),
        "torch_dtype": dtype,
    }


def export_sglang_files(model: Eagle3Drafter, out_dir: Path, *, dtype: str = "bfloat16") -> Path:
    """``config.json`` + ``model.safetensors`` in SGLang's ``LlamaForCausalLMEagle3`` layout."""
    if model.config.norm_before_fc:
        raise ValueError("SGLang cannot serve a drafter with norm_before_fc (see drafter/kinds/llama.py); export it for vLLM")
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
    cfg = _config_from_llama(c, c["draft_vocab_size"], c.get("target_hidden_size") or c["hidden_size"],
                             c["eagle_config"]["eagle_aux_hidden_state_layer_ids"], **switches_from_config(c, "sglang"))
    return rebuild_drafter(cfg, load_file(str(export_dir / "model.safetensors")), embeddings)


# ----------------------------------------------------------------------------- vLLM / speculators


def _to_speculators_name(k: str) -> str:
    return "layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k


def _from_speculators_name(k: str) -> str:
    return "midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k


def vllm_config(cfg: DrafterConfig, *, dtype: str, verifier: str, verifier_architectures: list[str],
                speculative_tokens: int) -> dict:
    from eagle3_assets.target.layers import to_speculators_ids

    return {
        "architectures": [SPECULATORS_ARCH],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": {**_llama_fields(cfg), "architectures": ["LlamaForCausalLM"]},
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": to_speculators_ids(cfg.aux_layer_ids),
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
    cfg = _config_from_llama(layer, c["draft_vocab_size"], c.get("target_hidden_size") or layer["hidden_size"],
                             [i - 1 for i in c["eagle_aux_hidden_state_layer_ids"]],
                             norm_before_fc=bool(c.get("norm_before_fc", False)), **switches_from_config(c, "vllm"))
    weights = {_from_speculators_name(k): v for k, v in load_file(str(export_dir / "model.safetensors")).items()}
    emb = weights.pop("embed_tokens.weight", None)
    if embeddings is None:
        if emb is None:
            raise ValueError(f"{export_dir}: no embed_tokens.weight; pass the target's embeddings")
        embeddings = emb
    return rebuild_drafter(cfg, weights, embeddings)


SGLANG_CONFIG_KEYS = ("architectures", "draft_vocab_size", "vocab_size", "hidden_size", "max_position_embeddings",
                      "num_attention_heads", "num_key_value_heads", "rope_theta", "eagle_config")


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
    problems += switch_problems(cfg, names, "sglang")
    if dtypes.get("d2t") not in (None, "I64"):
        problems.append(f"d2t is {dtypes['d2t']}, not int64")
    if dtypes.get("t2d") not in (None, "BOOL"):
        problems.append(f"t2d is {dtypes['t2d']}, not bool")
    if "lm_head.weight" in shapes and shapes["lm_head.weight"][0] != cfg.get("draft_vocab_size"):
        problems.append(f"lm_head rows {shapes['lm_head.weight'][0]} != draft_vocab_size {cfg.get('draft_vocab_size')}")
    if "t2d" in shapes and shapes["t2d"][0] != cfg.get("vocab_size"):
        problems.append(f"t2d length {shapes['t2d'][0]} != vocab_size {cfg.get('vocab_size')}")
    problems += _shared_problems(cfg, cfg, (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"),
                                 "config.json")
    return problems


def _shared_problems(layer: dict, top: dict, sglang_ids, where: str, vllm_ids=None) -> list[str]:
    """Rope, head shape and aux-layer problems both engines' loaders would misread (the aux ids in
    the export's own numbering: ``vllm_ids`` for a vLLM export, else ``sglang_ids``)."""
    from eagle3_assets.target.layers import sglang_shift_problem, vllm_shift_problem

    problems = export_rope_problems(layer, where)
    heads, head_dim = layer.get("num_attention_heads"), layer.get("head_dim")
    if heads and layer.get("hidden_size") and not head_dim and layer["hidden_size"] % heads:
        problems.append(f"{where}: no head_dim and hidden_size {layer['hidden_size']} is not a multiple of {heads} heads")
    if sglang_ids or vllm_ids:
        shift = vllm_shift_problem(list(vllm_ids)) if vllm_ids else sglang_shift_problem(list(sglang_ids))
        if shift:
            problems.append(shift)
    if top.get("target_hidden_size") and layer.get("hidden_size") and top["target_hidden_size"] != layer["hidden_size"]:
        problems.append(f"{where}: target_hidden_size {top['target_hidden_size']} differs from hidden_size "
                        f"{layer['hidden_size']}; this drafter's fc maps 3 x target_hidden_size to hidden_size of the same width")
    return problems


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
    problems += switch_problems(cfg, names, "vllm")
    return problems + _shared_problems(layer, cfg, None, "transformer_layer_config", vllm_ids=ids)


# ----------------------------------------------------------------------------- the kind

# option -> (engine that cannot serve it, why), for options that are on
UNSERVED = {
    "norm_before_fc": ("sglang", "SGLang's LlamaForCausalLMEagle3 has no norm before fc and would run fc on the raw "
                                 "features; set engines = [\"vllm\"] to export this drafter for vLLM alone"),
}


# EAGLE 3.1 switch -> {engine: the module of its pinned release that reads it for this kind}
# (tests/integration check each against the installed engine); an engine missing here is refused.
SWITCH_READERS = {key: {"sglang": "sglang.srt.models.llama_eagle3", "vllm": "vllm.model_executor.models.llama_eagle3"}
                  for key in SWITCH_KEYS}


def layout_problems(shape) -> dict[str, str]:
    """``{recipe key: problem}`` for the options of ``shape`` (a ``DraftShape``) that one of its
    ``engines`` would not run as trained."""
    return {**{key: f"cannot be served by {engine}: {why}" for key, (engine, why) in UNSERVED.items()
               if getattr(shape, key) and engine in shape.engines}, **unread_switches(shape, SWITCH_READERS)}


def target_notes(target_config: dict) -> list[str]:
    """What an engine will not serve of a Llama-style drafter next to this target."""
    from eagle3_assets.engines.versions import target_family
    from eagle3_assets.engines.vllm.versions import CPU_BLOCK_ERROR

    if target_family(target_config) is None:
        return []
    return ["Llama-style drafter on an MLA target: SGLang (>= 0.5.10) and vLLM GPU builds (>= 0.18.0) serve it, "
            f"vLLM's CPU build does not ('{CPU_BLOCK_ERROR}'); attention = \"mla\" serves on all three"]


EXPORTS = {"sglang": export_sglang_files, "vllm": export_vllm_files}
LOADS = {"sglang": load_sglang_files, "vllm": load_vllm_files}
CHECKS = {"sglang": sglang_file_problems, "vllm": vllm_file_problems}

KIND = DrafterKind(
    name="llama",
    attention=Attention,
    target_shape=None,
    layout_problems=layout_problems,
    target_notes=target_notes,
    export=lambda model, out_dir, *, engine, **options: EXPORTS[engine](model, out_dir, **options),
    load=lambda export_dir, embeddings, *, engine: LOADS[engine](export_dir, embeddings),
    check=lambda export_dir, engine: CHECKS[engine](export_dir),
    recognises=lambda config: config.get("architectures") == [SGLANG_ARCH] or config.get("speculators_model_type") == "eagle3",
)
