"""CPU versions of the ``sgl_kernel`` speculative-decoding ops SGLang's EAGLE worker calls on a CPU.

A CPU-built sgl_kernel has them (``sgl-kernel/csrc/cpu/spec.cpp``); the PyPI wheels do not. Each follows
the Triton kernel SGLang runs on a GPU (named in its docstring; ``sglang/kernels/ops/speculative/``) and
the argument order of the Python wrappers in ``sgl_kernel/speculative.py``, and is registered under
SGLang's own name so its code calls it unchanged. Index bookkeeping only: loops over the batch.
"""

from __future__ import annotations

import torch
from sgl_kernel_cpu_ops import register


def _ints(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.reshape(-1).tolist()]


@register("assign_req_to_token_pool_cpu(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, "
          "Tensor end_offset, Tensor out_cache_loc, int pool_len) -> ()")
def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """``assign_req_to_token_pool`` (mem_cache/allocation.py): request ``i``'s row of ``req_to_token``,
    columns ``start[i]:end[i]``, gets the next ``end[i]-start[i]`` entries of ``out_cache_loc``."""
    flat = req_to_token.view(-1)
    at = 0
    for rpi, s, e in zip(_ints(req_pool_indices), _ints(start_offset), _ints(end_offset)):
        n = e - s
        flat[rpi * pool_len + s: rpi * pool_len + e] = out_cache_loc[at: at + n].to(flat.dtype)
        at += n


@register("assign_extend_cache_locs_cpu(Tensor req_pool_indices, Tensor req_to_token, Tensor start_offset, "
          "Tensor end_offset, Tensor(a!) out_cache_loc, int pool_len) -> ()")
def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """``assign_extend_cache_locs`` (kernels/ops/speculative/cache_locs.py): the inverse gather, request
    ``i``'s slots ``start[i]:end[i]`` packed one request after another into ``out_cache_loc``."""
    flat = req_to_token.view(-1)
    at = 0
    for rpi, s, e in zip(_ints(req_pool_indices), _ints(start_offset), _ints(end_offset)):
        n = e - s
        out_cache_loc[at: at + n] = flat[rpi * pool_len + s: rpi * pool_len + e].to(out_cache_loc.dtype)
        at += n


@register("assign_draft_cache_locs_contiguous_cpu(Tensor req_pool_indices, Tensor req_to_token, Tensor seq_lens, "
          "Tensor(a!) out_cache_loc, int pool_len, int topk, int num_steps) -> ()")
def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk,
                                           num_steps):
    """``assign_draft_cache_locs_contiguous`` (cache_locs.py): request ``i`` copies the ``topk*num_steps``
    slots from column ``seq_lens[i]`` of its row into ``out_cache_loc[i*topk*num_steps:]``."""
    flat = req_to_token.view(-1)
    n = topk * num_steps
    for i, (rpi, sl) in enumerate(zip(_ints(req_pool_indices), _ints(seq_lens))):
        out_cache_loc[i * n:(i + 1) * n] = flat[rpi * pool_len + sl: rpi * pool_len + sl + n].to(out_cache_loc.dtype)


@register("build_draft_decode_metadata_cpu(Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, int topk, "
          "int num_steps, int pool_len) -> Tensor")
def build_draft_decode_metadata_cpu(req_to_token, req_pool_indices, seq_lens, topk, num_steps, pool_len):
    """The intel_amx draft backend's expanded ``req_to_token`` (spec.cpp; the GPU backends build the same
    rows in their own metadata): row ``b*topk+k`` is request ``b``'s committed prefix followed by
    candidate ``k``'s ``num_steps`` draft slots (laid out at ``seq_len + k*num_steps``). Columns past
    ``seq_len + num_steps`` are undefined (here: zero)."""
    out = torch.zeros((len(_ints(req_pool_indices)) * topk, pool_len), dtype=req_to_token.dtype)
    for b, (rpi, sl) in enumerate(zip(_ints(req_pool_indices), _ints(seq_lens))):
        row = req_to_token[rpi]
        for k in range(topk):
            out[b * topk + k, :sl] = row[:sl]
            out[b * topk + k, sl: sl + num_steps] = row[sl + k * num_steps: sl + (k + 1) * num_steps]
    return out


@register("fill_bonus_tokens_cpu(Tensor accept_tokens, Tensor accept_lens, Tensor(a!) bonus_tokens, "
          "int accept_stride) -> ()")
def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """``fill_bonus_tokens`` (kernels/ops/speculative/eagle.py): the last accepted token of each request,
    ``accept_tokens.flat[stride*i + accept_lens[i] - 1]``."""
    flat = accept_tokens.reshape(-1)
    for i, n in enumerate(_ints(accept_lens)):
        bonus_tokens[i] = flat[accept_stride * i + n - 1]


@register("fill_accept_out_cache_loc_cpu(Tensor accept_index, Tensor out_cache_loc, "
          "Tensor(a!) accept_out_cache_loc) -> ()")
def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """``fill_accept_out_cache_loc`` (eagle.py): ``out_cache_loc`` at the accepted (not -1) entries of
    ``accept_index``, packed in order."""
    dst = 0
    for src in _ints(accept_index):
        if src > -1:
            accept_out_cache_loc[dst] = out_cache_loc[src]
            dst += 1


@register("rotate_input_ids_cpu(Tensor(a!) input_ids, Tensor extend_start_loc, Tensor extend_seq_lens, "
          "Tensor topk_index, Tensor? select_index=None) -> ()")
def rotate_input_ids_cpu(input_ids, extend_start_loc, extend_seq_lens, topk_index, select_index=None):
    """``rotate_input_ids_kernel`` (kernels/ops/speculative/multi_layer_eagle.py): each request's extend
    segment shifts left by one and its new token goes last (or at ``select_index[i]``)."""
    select = _ints(select_index) if select_index is not None else None
    for i, (start, n) in enumerate(zip(_ints(extend_start_loc), _ints(extend_seq_lens))):
        if n > 1:
            input_ids[start: start + n - 1] = input_ids[start + 1: start + n].clone()
        if n > 0:
            input_ids[select[i] if select is not None else start + n - 1] = topk_index.reshape(-1)[i]


@register("build_tree_kernel_efficient_cpu(Tensor parent_list, Tensor selected_index, Tensor verified_seq_len, "
          "Tensor(a!) tree_mask, Tensor(b!) positions, Tensor(c!) retrive_index, Tensor(d!) retrive_next_token, "
          "Tensor(e!) retrive_next_sibling, int topk, int depth, int draft_token_num, int tree_mask_mode) -> ()")
def build_tree_kernel_efficient_cpu(parent_list, selected_index, verified_seq_len, tree_mask, positions, retrive_index,
                                    retrive_next_token, retrive_next_sibling, topk, depth, draft_token_num,
                                    tree_mask_mode):
    """``sgl_build_tree_kernel_efficient_triton`` (kernels/ops/speculative/spec_tree.py): per request, the
    retrieval links (first child / next sibling, pre-filled -1), positions and the tree attention mask
    (mode 0 FULL_MASK rows include the prefix; mode 1 QLEN_ONLY is draft x draft)."""
    if tree_mask_mode not in (0, 1):
        raise RuntimeError("build_tree_kernel_efficient_cpu: only FULL_MASK (0) and QLEN_ONLY (1) on CPU")
    n = draft_token_num
    parents, sel, seqs = parent_list.tolist(), selected_index.tolist(), _ints(verified_seq_len)
    ri, rnt, rns = retrive_index.view(-1), retrive_next_token.view(-1), retrive_next_sibling.view(-1)
    pos, mask = positions.view(-1), tree_mask.view(-1)
    acc = 0
    for b, seq_len in enumerate(seqs):
        off, s_b, p_b = b * n, sel[b], parents[b]
        pos[off] = seq_len
        ri[off] = off
        for i in range(n - 1, 0, -1):
            ri[off + i] = off + i
            parent_tb = s_b[i - 1] // topk
            parent_position = 0
            if parent_tb > 0:
                token = p_b[parent_tb]
                while parent_position < n:
                    if s_b[parent_position] == token:
                        parent_position += 1
                        break
                    parent_position += 1
            if parent_position == n:
                continue
            first = int(rnt[off + parent_position])
            rnt[off + parent_position] = i
            if first != -1:
                rns[off + i] = first
        base = off * n if tree_mask_mode == 1 else b * n * n + acc
        width = n if tree_mask_mode == 1 else seq_len + n
        for tid in range(n):
            row = base + tid * width + (0 if tree_mask_mode == 1 else seq_len)
            mask[row] = True
            mask[row + 1: row + n] = False
            if tid == 0:
                continue
            depth_of, cur = 0, tid - 1
            while True:
                depth_of += 1
                mask[row + cur + 1] = True
                parent_tb = s_b[cur] // topk
                if parent_tb == 0:
                    break
                token = p_b[parent_tb]
                cur = next((c for c in range(n) if s_b[c] == token), n)
            pos[off + tid] = depth_of + seq_len
        acc += seq_len * n


@register("verify_tree_greedy_cpu(Tensor(a!) predicts, Tensor(b!) accept_index, Tensor(c!) accept_token_num, "
          "Tensor candidates, Tensor retrive_index, Tensor retrive_next_token, Tensor retrive_next_sibling, "
          "Tensor target_predict) -> ()")
def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                           retrive_next_sibling, target_predict):
    """``verify_tree_greedy_kernel_triton`` (spec_tree.py): walk each request's tree from the root, taking
    the first child whose draft token equals the target's argmax at the last accepted node; record the
    accepted flat indices, their count (bonus excluded) and the target's tokens along the path."""
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    cand, ri = candidates.tolist(), retrive_index.tolist()
    rnt, rns = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    target = _ints(target_predict)
    pred, acc = predicts.view(-1), accept_index.view(-1)
    for b in range(bs):
        last = ri[b][0]
        acc[b * steps] = last
        correct, cur = 0, 0
        for _ in range(1, steps):
            cur = rnt[b][cur]
            while cur != -1:
                if cand[b][cur] == target[last]:
                    pred[last] = target[last]
                    correct += 1
                    acc[b * steps + correct] = ri[b][cur]
                    last = ri[b][cur]
                    break
                cur = rns[b][cur]
            if cur == -1:
                break
        accept_token_num[b] = correct
        pred[last] = target[last]
