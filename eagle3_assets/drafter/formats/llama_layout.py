"""What the Llama-style drafter's two serving formats share: its Llama config fields, the config
read back, the rope, head-shape and aux-layer checks, so ``llama_sglang.py`` and ``llama_vllm.py``
differ only in their own layout."""

from __future__ import annotations

from eagle3_assets.drafter.model import DrafterConfig
from eagle3_assets.drafter.rope import AMBIGUOUS, SUPPORTED, YARN_KEYS, rope_fields, rope_type


def llama_fields(cfg: DrafterConfig) -> dict:
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


def config_from_llama(llama: dict, draft_vocab_size: int, target_hidden_size: int, aux_ids: list[int],
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


def shared_problems(layer: dict, top: dict, ids, where: str, serve) -> list[str]:
    """Rope, head shape and aux-layer problems both engines' loaders would misread (``ids`` in the
    export's own numbering, judged by the engine's ``serve`` role)."""
    problems = export_rope_problems(layer, where)
    heads, head_dim = layer.get("num_attention_heads"), layer.get("head_dim")
    if heads and layer.get("hidden_size") and not head_dim and layer["hidden_size"] % heads:
        problems.append(f"{where}: no head_dim and hidden_size {layer['hidden_size']} is not a multiple of {heads} heads")
    if ids:
        shift = serve.layer_ids_problem(list(ids))
        if shift:
            problems.append(shift)
    if top.get("target_hidden_size") and layer.get("hidden_size") and top["target_hidden_size"] != layer["hidden_size"]:
        problems.append(f"{where}: target_hidden_size {top['target_hidden_size']} differs from hidden_size "
                        f"{layer['hidden_size']}; this drafter's fc maps 3 x target_hidden_size to hidden_size of the same width")
    return problems


def export_rope_problems(cfg: dict, where: str = "config.json") -> list[str]:
    """What SGLang or vLLM would read differently from the trained drafter in a Llama draft config."""
    problems = []
    theta = cfg.get("rope_theta")
    scaling = cfg.get("rope_scaling")
    params = cfg.get("rope_parameters")
    if theta is None:
        problems.append(f"{where} lacks rope_theta (SGLang falls back to 10000)")
    kind = rope_type(scaling)
    if kind not in SUPPORTED:
        problems.append(f"{where}: rope_scaling type {kind!r} is not one the drafter was trained with")
    if scaling:
        bad = sorted(k for k in scaling if k in AMBIGUOUS)
        if bad:
            problems.append(f"{where}: rope_scaling carries {bad}, which SGLang and vLLM ignore for a Llama draft "
                            "but transformers applies")
        if kind == "yarn" and (scaling.get("rope_type") != "yarn"):
            problems.append(f"{where}: rope_scaling has no rope_type 'yarn' (newer SGLang reads rope_type only)")
        if kind == "yarn" and any(scaling.get(k) is None for k in YARN_KEYS):
            problems.append(f"{where}: yarn rope_scaling lacks one of {list(YARN_KEYS)}")
    if params is not None:
        p_kind = rope_type(params)
        if p_kind != kind:
            problems.append(f"{where}: rope_parameters ({p_kind}) and rope_scaling ({kind}) disagree")
        elif theta is not None and params.get("rope_theta") not in (None, theta):
            problems.append(f"{where}: rope_parameters.rope_theta {params.get('rope_theta')} != rope_theta {theta}")
        elif kind == "yarn" and any(params.get(k) != scaling.get(k) for k in YARN_KEYS):
            problems.append(f"{where}: rope_parameters and rope_scaling hold different yarn values")
    return problems
