"""The EAGLE-3 drafter: one Llama decoder layer fed by the target's own features.

Shapes (H = target hidden size, which is also the drafter's: it reuses the target embeddings):

    aux  [B, T, 3H] --fc--> h [B, T, H]            (three target layers, fused; optionally RMSNorm'd first:
                                                    ``norm_before_fc`` over all 3H, ``fc_norm`` per layer)
    ids  [B, T]     --embed_tokens (frozen)--> e [B, T, H]
    midlayer:  x = cat(input_layernorm(e), hidden_norm(h))        [B, T, 2H]
               h = h + o_proj(attention(q/k/v_proj(x)))           (residual is the raw h)
               h = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))  over the draft vocabulary; ``h`` (pre-norm) is the next step's hidden,
                               ``norm(h)`` with ``norm_output`` (EAGLE 3.1; ``carry``).

Module names are SGLang's ``LlamaForCausalLMEagle3`` weight names (``fc``, ``midlayer.*``,
``norm``, ``lm_head``, buffers ``d2t``/``t2d``), so export is a rename-free copy.

The layer is the same in training and decoding; only what a query may attend to differs, and
that lives in the attention contexts of ``drafter/contexts.py`` (``TTTContext`` for the unrolled
training-time test, ``KVCache`` for decoding). Training can keep each unrolled step's layer out
of memory until backward (``checkpoint=True``: the step is recomputed then), which is what
lets a K2.5-sized drafter train on 8,192-token agentic replies.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as recompute_in_backward

from eagle3_assets.drafter.contexts import KVCache, TTTContext  # noqa: F401  (KVCache: the decoders' import point)
from eagle3_assets.drafter.kinds import KINDS, get_kind
from eagle3_assets.drafter.norm import RMSNorm
from eagle3_assets.drafter.rope import drafter_rope_scaling, rope_frequencies

# ----------------------------------------------------------------------------- config


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int] = field(default_factory=list)  # "output of decoder layer k" ids
    rope_scaling: dict | None = None
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    attention: str = "llama"  # the drafter's kind: a name in drafter/kinds KINDS
    mla: dict | None = None  # the target's sizes a kind copies (its target_shape: MLA's, drafter/kinds/mla/)
    norm_before_fc: bool = False  # one RMSNorm over the [3H] features before fc (vLLM's ``input_norm``)
    fc_norm: bool = False  # EAGLE 3.1: one RMSNorm per aux layer's [H] features before fc (``fc_norm.{i}``)
    norm_output: bool = False  # EAGLE 3.1: the next step reads the post-norm state, not the pre-norm one

    def __post_init__(self):
        if self.hidden_act != "silu":
            raise ValueError(f"only the SwiGLU (silu) MLP is implemented, got {self.hidden_act!r}")
        if self.attention not in KINDS:
            raise ValueError(f"attention must be one of {sorted(KINDS)}, got {self.attention!r}")
        if (get_kind(self.attention).target_shape is not None) != (self.mla is not None):
            raise ValueError(f"attention {self.attention!r}: the target's sizes (mla) are for a kind that copies them "
                             "(a target_shape), and only it")
        self.rope_scaling = drafter_rope_scaling(self.rope_scaling)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def from_target(
        cls,
        target: dict,
        *,
        draft_vocab_size: int,
        aux_layer_ids: list[int] | None = None,
        intermediate_size: int | None = None,
        attention: str = "llama",
        norm_before_fc: bool = False,
        fc_norm: bool = False,
        norm_output: bool = False,
    ) -> DrafterConfig:
        """A drafter shaped like one layer of the target, from its ``config.json`` dict (the
        ``text_config`` of a multimodal wrapper such as Kimi-K2.5). The rope (theta and yarn
        scaling) is the target's; for an MLA target (DeepSeek-V3 / Kimi) whose ``head_dim`` means
        the rope width, the drafter's Llama heads are ``v_head_dim`` wide; ``attention="mla"``
        gives the drafter the target's own MLA shape instead."""
        from eagle3_assets.target.config import text_config
        from eagle3_assets.target.layers import resolve_layer_ids

        text = text_config(target)
        heads = int(text["num_attention_heads"])
        rope = text.get("rope_parameters") or {}
        theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
        scaling = text.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = dict(rope)
        if scaling and scaling.get("original_max_position_embeddings") is None and text.get("original_max_position_embeddings"):
            scaling = {**scaling, "original_max_position_embeddings": text["original_max_position_embeddings"]}
        mla = text.get("kv_lora_rank") is not None
        head_dim = text["v_head_dim"] if mla else (text.get("head_dim") or text["hidden_size"] // heads)
        return cls(
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(intermediate_size or text["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=int(text["max_position_embeddings"]),
            vocab_size=int(text["vocab_size"]),
            draft_vocab_size=int(draft_vocab_size),
            target_hidden_size=int(text["hidden_size"]),
            aux_layer_ids=resolve_layer_ids(int(text["num_hidden_layers"]), aux_layer_ids),
            rope_scaling=scaling,
            hidden_act=text.get("hidden_act", "silu"),
            attention=attention,
            mla=_target_shape(attention, text),
            norm_before_fc=norm_before_fc,
            fc_norm=fc_norm,
            norm_output=norm_output,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DrafterConfig:
        """Fields a dict from an older checkpoint lacks take their defaults."""
        return cls(**d)


def _target_shape(attention: str, text: dict) -> dict | None:
    """The target's sizes a drafter of this kind copies (None for kinds that copy none)."""
    if attention not in KINDS:
        raise ValueError(f"attention must be one of {sorted(KINDS)}, got {attention!r}")
    shape = get_kind(attention).target_shape
    return shape(text) if shape is not None else None


# ----------------------------------------------------------------------------- building blocks


class Rotary(nn.Module):
    """RoPE with the target's theta (and yarn scaling), in Llama's rotate-half layout, computed
    as the serving engines compute it from the exported config (see ``rope_frequencies``)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv_freq, self.attention_factor = rope_frequencies(head_dim, theta, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq  # [B, T, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        a = self.attention_factor
        return (emb.cos() * a).to(dtype), (emb.sin() * a).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, T, d]; cos/sin [B, T, d]."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Llama GQA attention whose q/k/v read the 2H-wide concat of embedding and hidden."""

    @staticmethod
    def rotary(cfg: DrafterConfig) -> nn.Module:
        return Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(2 * h, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)

    def forward(self, x, cos, sin, context) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        rep = self.n_heads // self.n_kv  # grouped-query: each kv head serves `rep` query heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = context.attend(q, k, v, scale=1.0 / math.sqrt(self.head_dim))
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """SGLang's ``midlayer``: norms on both inputs, residual from the hidden stream."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on token embeddings
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the hidden stream
        self.self_attn = get_kind(cfg.attention).attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, emb, hidden, cos, sin, context) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        hidden = hidden + self.self_attn(x, cos, sin, context)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


# ----------------------------------------------------------------------------- the drafter


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        with torch.random.fork_rng(devices=[]):  # default inits must not move the global RNG
            self._build(cfg)

    def _build(self, cfg: DrafterConfig) -> None:
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)  # the target's, frozen, never exported to SGLang
        self.embed_tokens.weight.requires_grad_(False)
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(3 * cfg.target_hidden_size, cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(3))
        self.fc = nn.Linear(3 * cfg.target_hidden_size, h, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.rotary = get_kind(cfg.attention).attention.rotary(cfg)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    # -- setup

    def init_weights(self, seed: int) -> Eagle3Drafter:
        """Deterministic init from ``seed`` alone (normal(0, initializer_range), unit norms),
        without touching the global RNG."""
        device = next(p for n, p in self.named_parameters() if n != "embed_tokens.weight").device
        g = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name == "embed_tokens.weight":
                    continue
                if name.endswith("norm.weight") or name.startswith("fc_norm."):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32)
                            * self.config.initializer_range)
        return self

    def set_embeddings(self, weight: torch.Tensor) -> Eagle3Drafter:
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(f"target embeddings {tuple(weight.shape)} do not fit {tuple(self.embed_tokens.weight.shape)}")
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)
        return self

    def set_vocab_map(self, vmap) -> Eagle3Drafter:
        from eagle3_assets.drafter.vocab_map import check_vocab_map

        check_vocab_map(vmap, draft_vocab_size=self.config.draft_vocab_size, target_vocab_size=self.config.vocab_size)
        self.d2t.copy_(vmap.d2t)
        self.t2d.copy_(vmap.t2d)
        return self

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything but the frozen target embedding (which any loader re-reads from the target)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}

    # -- the pieces a decoder loop calls

    def project_aux(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[.., 3H] target features -> [.., H] hidden stream (the engines' order: ``input_norm`` over
        all 3H, then each layer's ``fc_norm``, then ``fc``)."""
        if self.config.norm_before_fc:
            aux_hidden = self.input_norm(aux_hidden)
        if self.config.fc_norm:
            chunks = aux_hidden.chunk(len(self.fc_norm), dim=-1)
            aux_hidden = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux_hidden)

    def step(self, ids, hidden, positions, context) -> torch.Tensor:
        """One pass of the midlayer: tokens ``ids`` with hidden stream ``hidden`` at ``positions``
        (all [B, T]); returns the pre-norm hidden output [B, T, H]."""
        emb = self.embed_tokens(ids)
        cos, sin = self.rotary(positions, hidden.dtype)
        return self.midlayer(emb, hidden, cos, sin, context)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def carry(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the next draft step reads of a step's pre-norm output: itself, or ``norm`` of it
        with ``norm_output`` (the state the engines hand back as the draft's hidden)."""
        return self.norm(hidden) if self.config.norm_output else hidden

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # -- training

    def forward(self, input_ids, aux_hidden, attention_mask=None, ttt_steps: int = 1, packed=None, *,
                checkpoint: bool = False, hidden_only: bool = False) -> list[torch.Tensor]:
        """Unrolled training-time test. Returns the draft logits [B, T, N] of every step.

        Step s at index t reads token ``input_ids[t + 1 + s]`` (ground truth, zero past the end)
        and predicts token ``t + 2 + s``. Step 0 reads the target's features at t; step s > 0
        reads the drafter's own output of step s - 1 at the same index (its chain; ``carry``).
        With ``packed`` (a ``drafter.packing.PackedBatch``) the inputs are its one row of
        samples back to back, and step s returns logits [n_s, N] of its ``logit_rows`` alone.
        ``checkpoint`` keeps only each step's input hidden stream and keys for backward and
        recomputes the rest of the step there; ``hidden_only`` returns each step's pre-norm
        hidden rows instead of logits (the trainer then runs the head in chunks).
        """
        if packed is not None:
            positions, context, shift, rows = packed.positions, packed.context(), packed.shift, packed.logit_rows
        else:
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids)
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            context, rows = TTTContext(attention_mask.bool()), None
            shift = lambda x, n: shift_left(x, n, fill=0)  # noqa: E731
        hidden = self.project_aux(aux_hidden)
        out = []
        for s in range(ttt_steps):
            args = (shift(input_ids, s + 1), self.carry(hidden) if s else hidden, positions + s, context, s)
            if checkpoint and torch.is_grad_enabled():
                hidden = recompute_in_backward(self._ttt_step, *args, use_reentrant=False, preserve_rng_state=False)
            else:
                hidden = self._ttt_step(*args)
            picked = hidden if rows is None else hidden[0, rows[s]]
            out.append(picked if hidden_only else self.logits(picked))
        return out

    def _ttt_step(self, ids, hidden, positions, context, s: int) -> torch.Tensor:
        """Unrolled step ``s``; a recomputation in backward replaces that step's own keys."""
        return self.step(ids, hidden, positions, context.at_step(s))


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, t + n] at index t along dim 1, ``fill`` past the end."""
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


def build_drafter(cfg: DrafterConfig, embeddings: torch.Tensor, vmap=None, *, seed: int = 0,
                  device: torch.device | str = "cpu", embed_dtype: torch.dtype | None = None) -> Eagle3Drafter:
    """A freshly initialised drafter with the target's embeddings (and a vocabulary map), built
    directly on ``device``: the modules are laid out on the meta device (no default init of
    2B parameters on a CPU), then materialised there and drawn from ``seed`` by a generator of
    that device (on CPU: the values ``init_weights`` always drew). The frozen embedding is held
    in ``embed_dtype`` (default float32; the target's bf16 rows lose nothing in bf16)."""
    device = torch.device(device)
    with torch.device("meta"):
        model = Eagle3Drafter(cfg)
    model = model.to_empty(device=device)
    model.rotary = get_kind(cfg.attention).attention.rotary(cfg).to(device)  # its buffers are computed, not drawn
    if embed_dtype is not None:
        model.embed_tokens.to(embed_dtype)
    model.init_weights(seed).set_embeddings(embeddings)
    model.d2t.zero_()
    model.t2d.zero_()
    if vmap is not None:
        model.set_vocab_map(vmap)
    return model
