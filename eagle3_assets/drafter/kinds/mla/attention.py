"""Multi-head latent attention (DeepSeek-V3 / Kimi-K2.5's MLA) for the drafter's one layer.

The drafter's ``attention = "mla"`` option: the layer keeps its EAGLE-3 wiring (input
``cat(input_layernorm(e), hidden_norm(h))`` of width 2H, raw-hidden residual, dense SwiGLU MLP)
and swaps Llama attention for the target's own attention shape, as vLLM's
``Eagle3DeepseekV2ForCausalLM`` and SGLang's DeepSeek EAGLE-3 draft build it::

    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))       [B, T, heads * (nope + rope)]   (or q_proj(x))
    c, k_r = split(kv_a_proj_with_mqa(x))               latent [B, T, kv_lora_rank], shared rope key
    k_n, v = split(kv_b_proj(kv_a_layernorm(c)))        per head: nope key, value
    k      = cat(k_n, rope(k_r)),  q = cat(q_n, rope(q_r))

The rope is DeepSeek's: interleaved pairs (vLLM's ``is_neox_style=False``) over the 64-wide rope
part, yarn frequencies, cos/sin scaled by ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``
and the softmax scale by ``mscale(factor, mscale_all_dim) ** 2`` (SGLang's and vLLM's
``deepseek_yarn``, transformers' DeepseekV3). Attention goes through the same context objects
as Llama attention (``TTTContext`` in training, ``KVCache`` in decoding), so the training-time
test mask applies unchanged; keys and values are kept expanded (per head), not as the latent.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from eagle3_assets.drafter.norm import RMSNorm
from eagle3_assets.drafter.rope import drafter_rope_scaling, rope_frequencies

MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def mla_shape(text: dict) -> dict:
    """The target's MLA sizes and its yarn ``mscale`` / ``mscale_all_dim`` from its text config."""
    if text.get("kv_lora_rank") is None:
        raise ValueError("attention 'mla' needs an MLA target (a config with kv_lora_rank, as DeepSeek-V3 and "
                         "Kimi-K2.5 have); use attention 'llama' for this target")
    shape = {k: (None if text.get(k) is None else int(text[k])) for k in MLA_KEYS}
    scaling = text.get("rope_scaling") or text.get("rope_parameters") or {}
    shape["mscale"] = float(scaling.get("mscale") or 1.0)
    shape["mscale_all_dim"] = float(scaling.get("mscale_all_dim") or 0.0)
    return shape


def yarn_get_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(cfg) -> float:
    m = cfg.mla
    scale = (m["qk_nope_head_dim"] + m["qk_rope_head_dim"]) ** -0.5
    scaling = drafter_rope_scaling(cfg.rope_scaling)
    if scaling and m["mscale_all_dim"]:
        scale *= yarn_get_mscale(scaling["factor"], m["mscale_all_dim"]) ** 2
    return scale


class MLARotary(nn.Module):
    """DeepSeek's rope on the rope part: cos/sin [B, T, rope] with each frequency repeated for
    its interleaved pair, scaled by the yarn magnitude ratio."""

    def __init__(self, cfg):
        super().__init__()
        m = cfg.mla
        inv_freq, _ = rope_frequencies(m["qk_rope_head_dim"], cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        scaling = drafter_rope_scaling(cfg.rope_scaling)
        factor = scaling["factor"] if scaling else 1.0
        self.magnitude = yarn_get_mscale(factor, m["mscale"]) / yarn_get_mscale(factor, m["mscale_all_dim"])

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = (positions.float()[..., None] * self.inv_freq).repeat_interleave(2, dim=-1)
        return (freqs.cos() * self.magnitude).to(dtype), (freqs.sin() * self.magnitude).to(dtype)


def apply_interleaved_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, T, rope]; pairs (x0, x1), (x2, x3), ... rotated by one frequency each."""
    rotated = torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)
    return x * cos[:, None] + rotated * sin[:, None]


class MLAAttention(nn.Module):
    """MLA whose projections read the 2H-wide concat of embedding and hidden (weight names are
    DeepSeek's, which both engines' EAGLE-3 loaders read)."""

    def __init__(self, cfg):
        super().__init__()
        m, h = cfg.mla, cfg.hidden_size
        self.n_heads = cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = m["qk_nope_head_dim"], m["qk_rope_head_dim"], m["v_head_dim"]
        self.kv_lora_rank = m["kv_lora_rank"]
        qk = self.nope + self.rope
        if m["q_lora_rank"]:
            self.q_a_proj = nn.Linear(2 * h, m["q_lora_rank"], bias=False)
            self.q_a_layernorm = RMSNorm(m["q_lora_rank"], cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(m["q_lora_rank"], self.n_heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(2 * h, self.n_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * h, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, h, bias=False)
        self.scale = mla_softmax_scale(cfg)

    @staticmethod
    def rotary(cfg) -> nn.Module:
        return MLARotary(cfg)

    def forward(self, x, cos, sin, context) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_a_proj") else self.q_proj(x)
        q_nope, q_rot = q.view(b, t, self.n_heads, -1).transpose(1, 2).split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, t, self.n_heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rot = apply_interleaved_rotary(k_rot[:, None], cos, sin).expand(-1, self.n_heads, -1, -1)
        q = torch.cat([q_nope, apply_interleaved_rotary(q_rot, cos, sin)], dim=-1)
        k = torch.cat([k_nope, k_rot], dim=-1)
        out = context.attend(q, k, v, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
