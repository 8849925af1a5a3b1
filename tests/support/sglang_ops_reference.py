"""Run in SGLang's environment (``.venv-sglang``) by tests/integration/sglang/test_sglang_cpu_ops.py: each of the project's
CPU ``sgl_kernel`` ops against SGLang's own definition of it, on the same inputs.

The speculative ops are compared with SGLang's Triton kernels, run by Triton's interpreter
(``TRITON_INTERPRET=1``: the kernel's own code, executed on the CPU); the attention ops with SGLang's
torch-native backend (``TorchNativeAttnBackend._run_sdpa_forward_extend`` / ``_decode``). Prints one
``ok <op>`` line per op; any mismatch raises.
"""

from __future__ import annotations

import sgl_kernel_attention_ops  # noqa: F401
import sgl_kernel_spec_ops  # noqa: F401
import torch

OPS = torch.ops.sgl_kernel
G = torch.Generator().manual_seed(0)


def same(name, got, want):
    for g, w in zip(got, want):
        if not torch.equal(g, w):
            raise AssertionError(f"{name}: {g.tolist()} != {w.tolist()}")
    print("ok", name, flush=True)


def cache_locs():
    from sglang.kernels.ops.speculative.cache_locs import assign_draft_cache_locs_contiguous, assign_extend_cache_locs
    from sglang.srt.mem_cache.allocation import assign_req_to_token_pool

    pool_len = 24
    rtt = torch.randint(0, 1000, (5, pool_len), dtype=torch.int32, generator=G)
    rpi = torch.tensor([3, 0, 4], dtype=torch.int64)
    start, end = torch.tensor([2, 0, 5], dtype=torch.int64), torch.tensor([6, 3, 13], dtype=torch.int64)
    n = int((end - start).sum())
    want, got = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
    assign_extend_cache_locs[(3,)](rpi, rtt, start, end, want, pool_len, 4)
    OPS.assign_extend_cache_locs_cpu(rpi, rtt, start, end, got, pool_len)
    same("assign_extend_cache_locs_cpu", [got], [want])

    locs = torch.randint(0, 1000, (n,), dtype=torch.int64, generator=G)
    want, got = rtt.clone(), rtt.clone()
    assign_req_to_token_pool[(3,)](rpi, want, start, end, locs, pool_len, 4)
    OPS.assign_req_to_token_pool_cpu(rpi, got, start, end, locs, pool_len)
    same("assign_req_to_token_pool_cpu", [got], [want])

    seq = torch.tensor([4, 1, 9], dtype=torch.int64)
    topk, steps = 2, 3
    want, got = torch.zeros(3 * topk * steps, dtype=torch.int64), torch.zeros(3 * topk * steps, dtype=torch.int64)
    assign_draft_cache_locs_contiguous[(3,)](rpi, rtt, seq, want, pool_len, topk, steps, BS=3)
    OPS.assign_draft_cache_locs_contiguous_cpu(rpi, rtt, seq, got, pool_len, topk, steps)
    same("assign_draft_cache_locs_contiguous_cpu", [got], [want])


def eagle_small_ops():
    from sglang.kernels.ops.speculative.eagle import fill_accept_out_cache_loc, fill_bonus_tokens
    from sglang.kernels.ops.speculative.multi_layer_eagle import rotate_input_ids_kernel

    tokens = torch.randint(0, 500, (3, 4), dtype=torch.int32, generator=G)
    lens = torch.tensor([1, 4, 2], dtype=torch.int32)
    want, got = torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    fill_bonus_tokens[(3,)](tokens, lens, want, 4)
    OPS.fill_bonus_tokens_cpu(tokens, lens, got, 4)
    same("fill_bonus_tokens_cpu", [got], [want])

    index = torch.tensor([0, -1, -1, 4, 5, 6, 8, -1, -1], dtype=torch.int32)
    ocl = torch.randint(0, 999, (12,), dtype=torch.int64, generator=G)
    want, got = torch.full((5,), -7, dtype=torch.int64), torch.full((5,), -7, dtype=torch.int64)
    fill_accept_out_cache_loc[(9,)](index, ocl, want, 16)
    OPS.fill_accept_out_cache_loc_cpu(index, ocl, got)
    same("fill_accept_out_cache_loc_cpu", [got], [want])

    ids = torch.randint(0, 500, (11,), dtype=torch.int64, generator=G)
    start, seq = torch.tensor([0, 3, 9], dtype=torch.int64), torch.tensor([3, 6, 2], dtype=torch.int64)
    new = torch.tensor([901, 902, 903], dtype=torch.int64)
    want, got = ids.clone(), ids.clone()
    rotate_input_ids_kernel[(3,)](want, start, seq, new, None, BLOCK_SIZE=8)
    OPS.rotate_input_ids_cpu(got, start, seq, new, None)
    same("rotate_input_ids_cpu", [got], [want])


def tree_ops():
    from sglang.kernels.ops.speculative.spec_tree import sgl_build_tree_kernel_triton, verify_tree_greedy_triton

    bs, topk, depth = 2, 2, 3
    n = 6  # draft tokens: the root + 5 picked from topk * depth candidates
    parent = torch.tensor([[-1, 0, 1, 2, 3], [-1, 0, 1, 3, 2]], dtype=torch.int64)  # [bs, topk*(depth-1)+1]
    selected = torch.tensor([[0, 1, 2, 4, 5], [0, 1, 3, 2, 6]], dtype=torch.int64)  # [bs, n-1]
    seq = torch.tensor([5, 3], dtype=torch.int64)
    for mode, size in ((1, bs * n * n), (0, int(seq.sum()) * n + bs * n * n)):
        outs = []
        for fn in (sgl_build_tree_kernel_triton, OPS.build_tree_kernel_efficient_cpu):
            mask = torch.zeros(size, dtype=torch.bool)
            pos = torch.zeros(bs * n, dtype=torch.int64)
            ri, rnt, rns = (torch.full((bs, n), -1, dtype=torch.int64) for _ in range(3))
            fn(parent, selected, seq, mask, pos, ri, rnt, rns, topk, depth, n, mode)
            outs.append([pos, ri, rnt, rns, mask])
        assert (outs[0][2] != -1).any() and (outs[0][3] != -1).any(), "the tree has children and siblings"
        same(f"build_tree_kernel_efficient_cpu mode {mode}", outs[1], outs[0])

    ri, rnt, rns = outs[0][1], outs[0][2], outs[0][3]
    cand = torch.randint(0, 6, (bs, n), dtype=torch.int64, generator=G)
    for trial in range(4):
        target = torch.randint(0, 6, (bs, n), dtype=torch.int64, generator=torch.Generator().manual_seed(trial))
        if trial == 0:
            target = cand.roll(-1, dims=1)  # the chain along first children is accepted
        res = []
        for fn in (verify_tree_greedy_triton, OPS.verify_tree_greedy_cpu):
            pred = torch.full((bs * n,), -1, dtype=torch.int32)
            acc = torch.full((bs, depth + 1), -1, dtype=torch.int32)
            num = torch.zeros(bs, dtype=torch.int32)
            fn(pred, acc, num, cand, ri, rnt, rns, target)
            res.append([pred, acc, num])
        if trial == 0:
            assert int(res[0][2].sum()) > 0, "the first trial accepts drafts"
        same(f"verify_tree_greedy_cpu trial {trial}", res[1], res[0])


def attention_ops():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    native = object.__new__(TorchNativeAttnBackend)
    heads, kv_heads, dim, pool = 4, 2, 8, 64
    k_cache = torch.randn(pool, kv_heads, dim, generator=G)
    v_cache = torch.randn(pool, kv_heads, dim, generator=G)
    rtt = torch.randperm(pool, generator=G).to(torch.int32).view(2, 32)
    rpi = torch.tensor([1, 0], dtype=torch.int64)
    seq = torch.tensor([9, 5], dtype=torch.int64)
    ext = torch.tensor([4, 5], dtype=torch.int64)  # the second has no prefix
    start = torch.tensor([0, 4], dtype=torch.int64)
    q = torch.randn(int(ext.sum()), heads, dim, generator=G)
    scale = dim ** -0.5
    want, got = torch.zeros_like(q), torch.zeros_like(q)
    native._run_sdpa_forward_extend(q, want, k_cache, v_cache, rtt, rpi, seq, seq - ext, ext, scaling=scale,
                                    enable_gqa=True, causal=True)
    OPS.extend_attention_cpu(q, None, None, got, k_cache, v_cache, 1.0, 1.0, rtt, rpi, seq, ext, start, 5, scale, 0.0,
                             False, 0, None, None, None, True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    print("ok extend_attention_cpu", flush=True)

    # DeepSeek's MLA prefill (no prefix): full-head keys and values passed as k_extend/v_extend while
    # the cache holds a latent of another width; the reference stores them in a cache of their own shape
    nope_rope, dv, latent = 12, 6, 20
    qm = torch.randn(7, heads, nope_rope, generator=G)
    km, vm = torch.randn(7, heads, nope_rope, generator=G), torch.randn(7, heads, dv, generator=G)
    rtt_m = torch.randperm(pool, generator=G).to(torch.int32).view(2, 32)
    seq_m, ext_m, start_m = torch.tensor([3, 4]), torch.tensor([3, 4]), torch.tensor([0, 3])
    k_ref, v_ref = torch.zeros(pool, heads, nope_rope), torch.zeros(pool, heads, dv)
    for b, (n, s0) in enumerate(zip(ext_m.tolist(), start_m.tolist())):
        k_ref[rtt_m[rpi[b], :n].long()], v_ref[rtt_m[rpi[b], :n].long()] = km[s0: s0 + n], vm[s0: s0 + n]
    want, got = torch.zeros(7, heads, dv), torch.zeros(7, heads, dv)
    native._run_sdpa_forward_extend(qm, want, k_ref, v_ref, rtt_m, rpi, seq_m, seq_m - ext_m, ext_m, scaling=scale,
                                    enable_gqa=True, causal=True)
    latent_cache = torch.randn(pool, 1, latent, generator=G)  # what an MLA pool holds: never read here
    OPS.extend_attention_cpu(qm, km, vm, got, latent_cache, latent_cache[..., :16], 1.0, 1.0, rtt_m, rpi, seq_m, ext_m,
                             start_m, 4, scale, 0.0, False, 0, None, None, None, True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    print("ok extend_attention_cpu mla prefill", flush=True)

    qd = torch.randn(2, heads, dim, generator=G)
    new_k, new_v = torch.randn(2, kv_heads, dim, generator=G), torch.randn(2, kv_heads, dim, generator=G)
    loc = torch.stack([rtt[1, 8], rtt[0, 4]]).long()  # the last slot of each sequence
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k_ref[loc], v_ref[loc] = new_k, new_v
    want, got = torch.zeros_like(qd), torch.zeros_like(qd)
    native._run_sdpa_forward_decode(qd, want, k_ref, v_ref, rtt, rpi, seq, scaling=scale, enable_gqa=True)
    logits = torch.zeros(2, heads, 8, dim + 1)
    OPS.decode_attention_cpu(qd, k_cache, v_cache, 1.0, 1.0, got, new_k, new_v, loc, logits, rtt, rpi, seq, scale, 0.0,
                             False, 0, None, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref), "decode_attention_cpu: KV not written at loc"
    print("ok decode_attention_cpu", flush=True)


if __name__ == "__main__":
    cache_locs()
    eagle_small_ops()
    tree_ops()
    attention_ops()
