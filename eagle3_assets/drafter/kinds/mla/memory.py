"""The MLA drafter's terms in the training memory estimate (``drafter/training/memory_plan.py``):
which SDPA kernel its attention gets, what one TTT step's attention keeps per token, and what a
step keeps for the later steps under recomputation. Read off ``attention.py``'s forward the way
the estimate reads the Llama layer; ``c`` is the compute dtype's size, ``s`` the TTT step."""

from __future__ import annotations


def kernel(cfg, device_type: str) -> str:
    """The "math" kernel on a CPU when q/k and v heads differ in width (its flash kernel refuses them), else "fused"."""
    m = cfg.mla
    if device_type == "cpu" and m["qk_nope_head_dim"] + m["qk_rope_head_dim"] != m["v_head_dim"]:
        return "math"
    return "fused"


def step_bytes(cfg, s: int, c: int, kernel: str) -> int:
    """Per token of step ``s``: the low-rank projections' norms, queries, keys and values of steps
    0..s, the output, softmax statistics (the math kernel: float32 scaled q and k instead), and
    under bf16 autocast the projections' copies of their input."""
    heads, m = cfg.num_attention_heads, cfg.mla
    qk, vd = heads * (m["qk_nope_head_dim"] + m["qk_rope_head_dim"]), heads * m["v_head_dim"]
    kvb = heads * (m["qk_nope_head_dim"] + m["v_head_dim"])
    qa, kvr, rope = m["q_lora_rank"] or 0, m["kv_lora_rank"], m["qk_rope_head_dim"]
    # q_a norm (input, normalised, q_b's input) and kv_a norm (its input is a view of the latent + rope key)
    lora = (3 * qa + (kvr + rope) + 2 * kvr) * c if c == 4 else (qa + kvr) * (4 + 2 + 2)
    values = kvb * c if s == 0 else (s + 1) * vd * c  # step 0's values view the kv_b output
    if kernel == "math":  # float32 whatever the compute dtype: scaled q and k, the values per sample
        return (lora + (s + 2) * qk * 4 + (kvb * c if s == 0 and c == 4 else (s + 1) * vd * 4) + vd * c + 2 * rope * c
                + _input_copies(cfg, c))
    keys = qk * c if s == 0 else (s + 1) * qk * c
    return lora + qk * c + keys + values + 2 * vd * c + heads * 4 + 2 * rope * c + _input_copies(cfg, c)


def _input_copies(cfg, c: int) -> int:
    """Under bf16 autocast the two projections reading the 2H input (q_a or q, kv_a) each keep a bf16 copy of it."""
    return 2 * 2 * cfg.hidden_size * 2 if c == 2 else 0


def kept_keys_bytes(cfg, c: int) -> int:
    """Per token under recomputation: the step's keys and the kv_b output its values view."""
    heads, m = cfg.num_attention_heads, cfg.mla
    return heads * (m["qk_nope_head_dim"] + m["qk_rope_head_dim"]) * c + heads * (m["qk_nope_head_dim"] + m["v_head_dim"]) * c
