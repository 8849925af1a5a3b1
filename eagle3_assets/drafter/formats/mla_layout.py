"""What the MLA drafter's two serving formats share: the DeepSeek EAGLE-3 draft both engines load,
written, read back and checked once, with the few things that differ between engines stated as
:class:`MlaTraits` by each format module (``mla_sglang.py``, ``mla_vllm.py``).

vLLM (``model_executor/models/deepseek_eagle3.py``, 0.32) and SGLang (``models/deepseek_eagle3.py``)
both read ``architectures: ["Eagle3DeepseekV2ForCausalLM"]``: one DeepSeek decoder layer whose MLA
projections read the 2H-wide concat, a dense MLP, ``fc`` over the aux states, ``hidden_norm``,
final ``norm``, ``lm_head`` over the draft vocabulary, ``d2t``/``t2d``. Both write the EAGLE 3.1
switches ``fc_norm`` and ``norm_output``, on or off, at the top level, where both engines read
them, and ``fc_norm.{0,1,2}.weight`` with ``fc_norm``. ``model_type`` is ``deepseek_v2`` in both,
because vLLM rewrites a ``deepseek_v3`` draft config into its MTP model
(``Eagle3DeepSeekMTPModel not supported``).

The rope is DeepSeek's yarn with ``mscale`` and ``mscale_all_dim``, which every DeepSeek reader
(vLLM's and SGLang's ``deepseek_yarn``, transformers' DeepseekV2/V3) applies the same way, so
unlike a Llama draft they are kept; ``attention_factor`` is refused (vLLM switches to another rope
when it is 1.0). Weight names are DeepSeek's (``q_a_proj``, ``kv_a_proj_with_mqa``, ...; the
engines fuse the first two at load) under ``midlayer.``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from eagle3_assets.drafter.export_files import (
    DTYPES,
    export_weights,
    rebuild_drafter,
    switch_fields,
    switch_problems,
    switches_from_config,
    write_dir_atomic,
)
from eagle3_assets.drafter.formats import ServingFormat
from eagle3_assets.drafter.kinds.mla.attention import MLA_KEYS, mla_shape
from eagle3_assets.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3_assets.drafter.rope import drafter_rope_scaling
from eagle3_assets.engines import engine_role


@dataclass(frozen=True)
class MlaTraits:
    """How one engine's copy of the MLA draft differs: ``engine`` (its serve role numbers the aux ids),
    ``carries_embeddings`` (``embed_tokens.weight`` written, equal to the target's),
    ``top_level_ids`` (the aux ids also at the config's top level, read there first, and
    ``norm_before_residual: false`` said outright), ``needs_q_lora_rank`` (its loader requires it),
    ``aux_norm_alias`` (it also reads ``fc_norm`` as ``use_aux_norm``), ``before_export`` (what must
    hold before writing it)."""

    engine: str
    carries_embeddings: bool = False
    top_level_ids: bool = False
    needs_q_lora_rank: bool = False
    aux_norm_alias: bool = False
    before_export: Callable[[], None] = lambda: None


MLA_ARCH = "Eagle3DeepseekV2ForCausalLM"
REQUIRED = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.self_attn.kv_a_proj_with_mqa.weight",
            "midlayer.self_attn.kv_b_proj.weight", "midlayer.self_attn.o_proj.weight")


def mla_rope_fields(cfg: DrafterConfig) -> dict:
    """``rope_theta`` with DeepSeek's yarn in both spellings (``rope_scaling`` for SGLang,
    ``rope_parameters`` for transformers 5 and vLLM), mscale keys included."""
    scaling = drafter_rope_scaling(cfg.rope_scaling)
    if scaling is None:
        return {"rope_theta": cfg.rope_theta, "rope_scaling": None,
                "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}
    scaling = {**scaling, "mscale": cfg.mla["mscale"], "mscale_all_dim": cfg.mla["mscale_all_dim"]}
    params = {"rope_theta": cfg.rope_theta, **{k: v for k, v in scaling.items() if k != "type"}}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling, "rope_parameters": params}


def mla_config(cfg: DrafterConfig, *, dtype: str, traits: MlaTraits) -> dict:
    ids = engine_role("serve", traits.engine).layer_ids(cfg.aux_layer_ids)
    out = {
        "architectures": [MLA_ARCH], "model_type": "deepseek_v2",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_attention_heads,
        **{k: cfg.mla[k] for k in MLA_KEYS}, "num_hidden_layers": 1, "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps, **mla_rope_fields(cfg), "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
        "attention_bias": False, "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        **switch_fields(cfg), "torch_dtype": dtype,
    }
    if traits.top_level_ids:
        out.update(eagle_aux_hidden_state_layer_ids=ids, norm_before_residual=False)
    return out


def export_mla(model: Eagle3Drafter, out_dir: Path, *, traits: MlaTraits, dtype: str = "bfloat16",
               **_speculators) -> Path:
    if model.config.attention != "mla":
        raise ValueError("export_mla needs a drafter with attention 'mla'")
    traits.before_export()
    weights = export_weights(model, DTYPES[dtype], embeddings=traits.carries_embeddings)
    return write_dir_atomic(out_dir, {"config.json": mla_config(model.config, dtype=dtype, traits=traits),
                                       "model.safetensors": weights})


def config_from_export(c: dict, traits: MlaTraits) -> DrafterConfig:
    ids = c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    return DrafterConfig(
        hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_attention_heads=c["num_attention_heads"], num_key_value_heads=c["num_key_value_heads"],
        head_dim=c["v_head_dim"], rms_norm_eps=c["rms_norm_eps"], rope_theta=c["rope_theta"],
        max_position_embeddings=c["max_position_embeddings"], vocab_size=c["vocab_size"],
        draft_vocab_size=c["draft_vocab_size"], target_hidden_size=c.get("target_hidden_size") or c["hidden_size"],
        aux_layer_ids=engine_role("serve", traits.engine).trained_ids(ids), rope_scaling=c.get("rope_scaling"),
        hidden_act=c.get("hidden_act", "silu"), attention="mla", mla=mla_shape(c),
        **switches_from_config(c, aux_norm_alias=traits.aux_norm_alias),
    )


def load_mla(export_dir: Path, embeddings, *, traits: MlaTraits) -> Eagle3Drafter:
    """Rebuild the drafter from an MLA export (one that carries its embedding uses it when none is given)."""
    from safetensors.torch import load_file

    export_dir = Path(export_dir)
    c = json.loads((export_dir / "config.json").read_text())
    weights = load_file(str(export_dir / "model.safetensors"))
    own = weights.pop("embed_tokens.weight", None)
    if embeddings is None:
        if own is None:
            raise ValueError(f"{export_dir}: no embed_tokens.weight; pass the target's embeddings")
        embeddings = own
    return rebuild_drafter(config_from_export(c, traits), weights, embeddings)


def check_mla_export(export_dir: Path, *, traits: MlaTraits) -> list[str]:
    """What the engine's DeepSeek EAGLE-3 loader would refuse or read differently (empty: none)."""
    from safetensors import safe_open

    export_dir = Path(export_dir)
    cfg_path, weights_path = export_dir / "config.json", export_dir / "model.safetensors"
    if not cfg_path.exists() or not weights_path.exists():
        return [f"{export_dir}: config.json or model.safetensors is missing"]
    c = json.loads(cfg_path.read_text())
    problems = [f"config.json lacks {k!r}" for k in (*MLA_KEYS[1:], "hidden_size", "intermediate_size",
                                                       "num_attention_heads", "draft_vocab_size", "vocab_size",
                                                       "max_position_embeddings", "rope_theta") if c.get(k) is None]
    if c.get("model_type") != "deepseek_v2":
        problems.append(f"model_type is {c.get('model_type')!r}: it must be 'deepseek_v2' (vLLM rewrites a "
                        "deepseek_v3 draft config into its MTP model and refuses to start)")
    if traits.needs_q_lora_rank and not c.get("q_lora_rank"):
        problems.append("q_lora_rank is missing: SGLang's MLA draft model requires it")
    if c.get("num_hidden_layers") != 1:
        problems.append(f"num_hidden_layers is {c.get('num_hidden_layers')}, not 1 (SGLang's loader requires 1)")
    ids = (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        problems.append("eagle_config.eagle_aux_hidden_state_layer_ids is missing")
    elif traits.top_level_ids and c.get("eagle_aux_hidden_state_layer_ids") not in (None, ids):
        problems.append("eagle_aux_hidden_state_layer_ids differs from eagle_config's (vLLM reads the top level first)")
    shift = engine_role("serve", traits.engine).layer_ids_problem(list(ids)) if ids else None
    if shift:
        problems.append(shift)
    if traits.top_level_ids and c.get("norm_before_residual") is not False:
        problems.append("norm_before_residual is not false: this drafter normalizes after taking the residual")
    problems += _rope_problems(c)
    if c.get("target_hidden_size") not in (None, c.get("hidden_size")):
        problems.append(f"target_hidden_size {c['target_hidden_size']} differs from hidden_size {c.get('hidden_size')}")
    with safe_open(str(weights_path), framework="pt") as f:
        names = set(f.keys())
        meta = {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in ("d2t", "t2d", "lm_head.weight",
                                                                                      "fc.weight") if k in names}
    problems += [f"model.safetensors lacks {k}" for k in REQUIRED if k not in names]
    problems += switch_problems(c, names, aux_norm_alias=traits.aux_norm_alias)
    if traits.carries_embeddings and "embed_tokens.weight" not in names:
        problems.append("model.safetensors lacks embed_tokens.weight (vLLM's copy carries the target's)")
    if not traits.carries_embeddings and "embed_tokens.weight" in names:
        problems.append("model.safetensors holds embed_tokens (SGLang takes the target's)")
    if meta.get("d2t", ("I64",))[0] != "I64" or meta.get("t2d", ("BOOL",))[0] != "BOOL":
        problems.append("d2t must be int64 and t2d bool")
    if "lm_head.weight" in meta and meta["lm_head.weight"][1][0] != c.get("draft_vocab_size"):
        problems.append(f"lm_head rows {meta['lm_head.weight'][1][0]} != draft_vocab_size {c.get('draft_vocab_size')}")
    if "t2d" in meta and meta["t2d"][1][0] != c.get("vocab_size"):
        problems.append(f"t2d length {meta['t2d'][1][0]} != vocab_size {c.get('vocab_size')}")
    width = len(ids or []) * (c.get("target_hidden_size") or c.get("hidden_size") or 0)
    if "fc.weight" in meta and ids and meta["fc.weight"][1][1] != width:
        problems.append(f"fc input width {meta['fc.weight'][1][1]} != {len(ids)} aux layers x target_hidden_size")
    return problems


def _rope_problems(c: dict) -> list[str]:
    scaling, params = c.get("rope_scaling"), c.get("rope_parameters")
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind not in ("default", "yarn"):
        return [f"rope_scaling type {kind!r} is not one the drafter was trained with"]
    problems = []
    if kind == "yarn":
        keys = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
        missing = [k for k in keys if scaling.get(k) is None]
        if missing:
            problems.append(f"yarn rope_scaling lacks {missing} (DeepSeek's rope reads all of them)")
        if "attention_factor" in scaling:
            problems.append("rope_scaling carries attention_factor, which makes vLLM pick another DeepSeek rope")
        if params is not None and any(params.get(k) != scaling.get(k) for k in keys):
            problems.append("rope_parameters and rope_scaling hold different yarn values")
    return problems


def mla_format(traits: MlaTraits, switch_readers: dict[str, str], aux_ids) -> ServingFormat:
    """The ``ServingFormat`` of the MLA draft for the engine ``traits`` describe."""
    return ServingFormat(kind="mla", engine=traits.engine, export=partial(export_mla, traits=traits),
                         load=partial(load_mla, traits=traits), check=partial(check_mla_export, traits=traits),
                         recognises=lambda config: config.get("architectures") == [MLA_ARCH], aux_ids=aux_ids,
                         switch_readers=switch_readers)
