"""The drafter's rotary embedding: the target's theta and yarn scaling, in one meaning for all readers.

A drafter trained with one rope and served with another drafts garbage, so the rope must mean
the same thing to the trainer, SGLang's ``LlamaForCausalLMEagle3`` and vLLM's EAGLE-3 loader.
Both engines build a Llama draft's yarn rope from ``factor``, ``original_max_position_embeddings``,
``beta_fast`` and ``beta_slow`` (plus ``attn_factor`` / ``extrapolation_factor`` where given) and
scale cos/sin by ``0.1 * ln(factor) + 1``; they ignore ``mscale`` / ``mscale_all_dim``, which
DeepSeek-V3 and Kimi-K2.5 carry for their own MLA attention (SGLang's ``deepseek_yarn``) and which
transformers *does* read (``attention_factor = mscale(factor, mscale) / mscale(factor, mscale_all_dim)``,
1.0 for K2.5 instead of 1.416). A drafter config therefore keeps only the keys every reader
agrees on (``drafter_rope_scaling``); the Llama formats' ``export_rope_problems``
(``drafter/formats/llama_layout.py``) refuse an exported config that carries anything else.
"""

from __future__ import annotations

import math

import torch

SUPPORTED = ("default", "yarn")
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
# keys a serving engine and transformers read differently (or not at all) for a Llama draft
AMBIGUOUS = ("mscale", "mscale_all_dim", "attention_factor", "attn_factor", "extrapolation_factor", "truncate",
             "apply_yarn_scaling")


def rope_type(scaling: dict | None) -> str:
    if not scaling:
        return "default"
    return scaling.get("rope_type") or scaling.get("type") or "default"


def drafter_rope_scaling(scaling: dict | None) -> dict | None:
    """The target's ``rope_scaling`` reduced to what the drafter implements and every reader
    agrees on: None for default rope, else ``{"rope_type": "yarn", "type": "yarn", factor,
    original_max_position_embeddings, beta_fast, beta_slow}``. Other rope types raise."""
    kind = rope_type(scaling)
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(f"rope scaling {kind!r} is not implemented for the drafter (only {', '.join(SUPPORTED)})")
    missing = [k for k in ("factor", "original_max_position_embeddings") if scaling.get(k) is None]
    if missing:
        raise ValueError(f"yarn rope scaling {scaling} lacks {missing}")
    out = {"rope_type": "yarn", "type": "yarn", "factor": float(scaling["factor"]),
           "original_max_position_embeddings": int(scaling["original_max_position_embeddings"]),
           "beta_fast": float(scaling.get("beta_fast") or 32.0), "beta_slow": float(scaling.get("beta_slow") or 1.0)}
    return out


def yarn_mscale(factor: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2], attention factor on cos/sin), as SGLang's and vLLM's
    ``YaRNScalingRotaryEmbedding`` compute them (and transformers, for the keys kept here)."""
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    scaling = drafter_rope_scaling(scaling)
    if scaling is None:
        return 1.0 / pos_freqs, 1.0
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(scaling["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(scaling["beta_slow"])), head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate by factor
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, yarn_mscale(factor)


def rope_fields(theta: float, scaling: dict | None) -> dict:
    """Config fields for an exported Llama draft: legacy ``rope_theta``/``rope_scaling`` (what
    SGLang reads) and transformers 5's ``rope_parameters`` (what vLLM and transformers read), equal."""
    scaling = drafter_rope_scaling(scaling)
    params = {"rope_type": "default", "rope_theta": float(theta)}
    if scaling:
        params = {"rope_theta": float(theta), **{k: v for k, v in scaling.items() if k != "type"}}
    return {"rope_theta": float(theta), "rope_scaling": scaling, "rope_parameters": params}
