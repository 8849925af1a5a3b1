"""The CPU stand-ins SGLang's CPU engine needs (eagle3_assets/engines/sglang/cpu), each against the
definition of the kernel it replaces; runs in the project's environment, no SGLang needed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import torch

from eagle3_assets.engines.sglang.cpu import HOOK_DIR, server_environment


def _ops():
    spec = importlib.util.spec_from_file_location("sgl_kernel_cpu_ops", HOOK_DIR / "sgl_kernel_cpu_ops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_copy_all_layer_kv_cache_moves_rows_in_every_buffer_reading_before_writing():
    """copy_all_layer_kv_cache_tiled: in each layer's buffer, row tgt[i] := row src[i] (bytes), with
    overlapping source and target rows (an in-place shift) read before any is written."""
    _ops()
    k = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    v = torch.arange(8 * 3, dtype=torch.bfloat16).reshape(8, 3) * -1
    src, tgt = torch.tensor([0, 1, 2, 6]), torch.tensor([1, 2, 3, 0])
    want_k, want_v = k.clone(), v.clone()
    want_k[tgt], want_v[tgt] = k[src].clone(), v[src].clone()
    ptrs = torch.tensor([k.data_ptr(), v.data_ptr()], dtype=torch.int64)
    strides = torch.tensor([k.stride(0) * k.element_size(), v.stride(0) * v.element_size()], dtype=torch.int64)
    torch.ops.sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_the_hook_declares_torchvision_schemas_in_a_fresh_interpreter():
    env = server_environment({k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(HOOK_DIR)
    probe = ("import torch\nprint(torch._C._dispatch_has_schema('torchvision::nms') if hasattr(torch._C, "
             "'_dispatch_has_schema') else bool(torch._C._jit_get_schemas_for_operator('torchvision::nms')))\n"
             "print(hasattr(torch.ops.sgl_kernel, 'copy_all_layer_kv_cache_cpu'))")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True"]


def test_the_hook_makes_cuda_synchronize_a_no_op_only_on_a_torch_without_cuda():
    """SGLang's K2.5 draft model calls torch.cuda.synchronize() after sharing the target's embedding;
    on this CPU torch it raises unless the hook is loaded."""
    env = server_environment({k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    probe = "import torch\nprint(torch.version.cuda is None, torch.cuda.synchronize())"
    hooked = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert hooked.returncode == 0, hooked.stderr[-2000:]
    assert hooked.stdout.split() == ["True", "None"]
    bare = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert bare.returncode != 0 and "not compiled with CUDA" in bare.stderr


# The tree mask SGLang 0.5.23's EAGLE worker passed to extend_attention_cpu on this CPU (top-k 2, 3 steps,
# 6 nodes; recorded from a real server's verify step): node i's row says which of the 6 new tokens it sees.
SGLANG_TREE_MASK = [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
                    [1, 1, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 0, 1, 0, 0, 1]]
TREE_PARENTS = [None, 0, 0, 1, 1, 2]  # root; its two drafts; two children of node 1, one of node 2


def test_extend_attention_with_sglangs_tree_mask_equals_sdpa_over_each_nodes_ancestors():
    """Verify of a draft tree: each node sees the whole prefix, its ancestors and itself, nothing else
    (reference: torch's scaled_dot_product_attention with that mask built from the parents)."""
    import importlib.util as iu

    sys.path.insert(0, str(HOOK_DIR))
    try:
        spec = iu.spec_from_file_location("sgl_kernel_attention_ops", HOOK_DIR / "sgl_kernel_attention_ops.py")
        spec.loader.exec_module(iu.module_from_spec(spec))
    finally:
        sys.path.remove(str(HOOK_DIR))
    g = torch.Generator().manual_seed(3)
    heads, dim, prefix, n, pool = 2, 8, 5, 6, 32
    k_cache, v_cache = torch.randn(pool, heads, dim, generator=g), torch.randn(pool, heads, dim, generator=g)
    rtt = torch.randperm(pool, generator=g).to(torch.int32).view(1, pool)
    q = torch.randn(n, heads, dim, generator=g)
    seen = torch.zeros(n, prefix + n, dtype=torch.bool)
    seen[:, :prefix] = True
    for i in range(n):
        j = i
        while j is not None:
            seen[i, prefix + j] = True
            j = TREE_PARENTS[j]
    slots = rtt[0, :prefix + n].long()
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1), attn_mask=seen,
        scale=dim ** -0.5).transpose(0, 1)
    args = (k_cache, v_cache, 1.0, 1.0, rtt, torch.tensor([0]), torch.tensor([prefix + n]), torch.tensor([n]),
            torch.tensor([0]), n, dim ** -0.5, 0.0, False, 0, None, None)
    got, chain = torch.zeros_like(q), torch.zeros_like(q)
    torch.ops.sgl_kernel.extend_attention_cpu(q, None, None, got, *args, torch.tensor(SGLANG_TREE_MASK).flatten(), True)
    torch.ops.sgl_kernel.extend_attention_cpu(q, None, None, chain, *args, None, True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(chain, want, atol=1e-3)  # the mask matters: causal order alone is wrong here


def test_the_cpu_support_turns_on_inside_a_process_that_has_not_imported_sglang():
    """A streaming producer started by a launcher that knows nothing of CPUs: the capture turns SGLang's
    CPU engine on in its own process (the switch, the hook folder first on sys.path, torchvision's op
    schemas declared and kept alive), once; a second call changes nothing."""
    import subprocess
    import sys

    probe = (
        "import os, sys, torch\n"
        "from eagle3_assets.engines.sglang.cpu import HOOK_DIR, enable_in_process\n"
        "first, second = enable_in_process(), enable_in_process()\n"
        "import gc; gc.collect()\n"
        "torch._C._dispatch_find_schema_or_throw('torchvision::nms', '')\n"
        "print(first, second, os.environ['SGLANG_USE_CPU_ENGINE'], sys.path[0] == str(HOOK_DIR))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False", "1", "True"]
