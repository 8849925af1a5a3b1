"""CPU versions of the two attention ops of SGLang's ``intel_amx`` backend, in plain torch.

SGLang's EAGLE worker on a CPU needs the ``intel_amx`` attention backend (the only CPU one with a
multi-step draft backend); it calls ``torch.ops.sgl_kernel.decode_attention_cpu`` and
``extend_attention_cpu``, which only a CPU-built sgl_kernel has (``sgl-kernel/csrc/cpu/decode.cpp``,
``extend.cpp``; AMX is used there only when present). These follow the Triton kernels SGLang runs on a
GPU (``sglang/kernels/ops/attention/decode_attention.py``, ``extend_attention.py``): paged KV read through
``req_to_token``, grouped-query heads, ``sm_scale``, the tanh logit cap, causal masking of the extend
part, and the draft-tree mask in verify. Argument order is the one ``intel_amx_backend.py`` passes.
Sliding windows, attention sinks, cross-attention and fp8 caches are refused, not approximated.
"""

from __future__ import annotations

import torch
from sgl_kernel_cpu_ops import register


def _refuse(sliding_window_size, is_cross_attention, sinks, k_scale, v_scale, what):
    if sliding_window_size > 0 or is_cross_attention or sinks is not None or k_scale != 1.0 or v_scale != 1.0:
        raise NotImplementedError(f"{what} (project CPU stand-in): no sliding window, sinks, cross-attention "
                                  "or scaled fp8 cache")


def _attend(q, keys, values, sm_scale, logit_cap, allowed=None):
    """q [n, H, D], keys [m, Hkv, D], values [m, Hkv, Dv] -> [n, H, Dv] in float32."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    if heads != kv_heads:
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)
        values = values.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q.float(), keys.float()) * sm_scale
    if logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnm,mhd->nhd", torch.softmax(scores, dim=-1), values.float())


@register("decode_attention_cpu(Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, float k_scale, float v_scale, "
          "Tensor(c!) output, Tensor? key, Tensor? value, Tensor loc, Tensor(d!) attn_logits, Tensor req_to_token, "
          "Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, bool is_cross_attention, "
          "int sliding_window_size, Tensor? encoder_lens, Tensor? sinks) -> ()")
def decode_attention_cpu(query, k_cache, v_cache, k_scale, v_scale, output, key, value, loc, attn_logits, req_to_token,
                         req_pool_indices, seq_lens, sm_scale, logit_cap, is_cross_attention, sliding_window_size,
                         encoder_lens, sinks):
    """``decode_attention_fwd``: one query token per sequence. When ``key``/``value`` are given they are
    first written to the caches at ``loc`` (the CPU kernel stores the new token's KV itself); sequence
    ``b`` then attends to the slots ``req_to_token[req_pool_indices[b], :seq_lens[b]]``."""
    _refuse(sliding_window_size, is_cross_attention, sinks, k_scale, v_scale, "decode_attention_cpu")
    if key is not None and value is not None:
        k_cache[loc] = key.to(k_cache.dtype)
        v_cache[loc] = value.to(v_cache.dtype)
    dv = output.shape[-1]
    for b, (rpi, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        slots = req_to_token[rpi, :n].long()
        out = _attend(query[b: b + 1], k_cache[slots], v_cache[slots][..., :dv], sm_scale, logit_cap)
        output[b] = out[0].to(output.dtype)


@register("extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, "
          "Tensor k_buffer, Tensor v_buffer, float k_scale, float v_scale, Tensor req_to_token, "
          "Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, "
          "int? max_len_extend, float sm_scale, float logit_cap, bool is_cross_attention, int sliding_window_size, "
          "Tensor? encoder_lens, Tensor? sinks, Tensor? custom_mask, bool is_causal) -> ()")
def extend_attention_cpu(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, k_scale, v_scale, req_to_token,
                         req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc, max_len_extend, sm_scale,
                         logit_cap, is_cross_attention, sliding_window_size, encoder_lens, sinks, custom_mask,
                         is_causal):
    """``extend_attention_fwd``: sequence ``b``'s ``extend_seq_lens[b]`` query tokens (from
    ``extend_start_loc[b]``) attend to its prefix, read from the caches through ``req_to_token``, and to
    the new tokens' own keys and values, ``k_extend``/``v_extend`` (the caches' rows when those are not
    given), as the Triton kernel does. The two can differ in shape: DeepSeek's MLA prefill calls this
    with full-head keys (nope + rope dims) while its cache holds the compressed latent, and then has no
    prefix. Query ``i`` sits at position ``prefix + i``; with ``is_causal`` it sees keys up to that
    position. ``custom_mask`` (verify of a draft tree, QLEN_ONLY layout: ``n x n`` per sequence,
    row-major) further limits which of the new tokens it sees."""
    _refuse(sliding_window_size, is_cross_attention, sinks, k_scale, v_scale, "extend_attention_cpu")
    dv = o_extend.shape[-1]
    tree_at = 0
    for rpi, total, n, start in zip(req_pool_indices.tolist(), seq_lens.tolist(), extend_seq_lens.tolist(),
                                    extend_start_loc.tolist()):
        if n == 0:
            continue
        prefix = total - n
        slots = req_to_token[rpi, :total].long()
        if k_extend is None or v_extend is None:  # the new tokens' rows are read back from the caches
            keys, values = k_buffer[slots], v_buffer[slots][..., :dv]
        else:
            keys, values = k_extend[start: start + n], v_extend[start: start + n][..., :dv]
            if prefix and keys.shape[1:] != k_buffer.shape[1:]:
                raise NotImplementedError(f"extend_attention_cpu (project CPU stand-in): new keys {tuple(keys.shape[1:])} "
                                          f"differ from the cache's {tuple(k_buffer.shape[1:])} with a prefix of {prefix}")
            if prefix:
                keys = torch.cat([k_buffer[slots[:prefix]], keys])
                values = torch.cat([v_buffer[slots[:prefix]][..., :dv], values])
        allowed = None
        if is_causal or custom_mask is not None:
            qpos = torch.arange(n).unsqueeze(1) + prefix
            kpos = torch.arange(total).unsqueeze(0)
            allowed = kpos <= qpos if is_causal else torch.ones(n, total, dtype=torch.bool)
            if custom_mask is not None:
                tree = custom_mask[tree_at: tree_at + n * n].view(n, n).bool()
                allowed = allowed.clone()
                allowed[:, prefix:] &= tree
                tree_at += n * n
        out = _attend(q_extend[start: start + n], keys, values, sm_scale, logit_cap, allowed)
        o_extend[start: start + n] = out.to(o_extend.dtype)
