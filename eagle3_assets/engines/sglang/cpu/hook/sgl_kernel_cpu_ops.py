"""CPU versions of the ``sgl_kernel`` ops SGLang's CPU engine calls and only a CPU-built sgl_kernel has.

Each op follows the definition of the kernel SGLang runs on a GPU (named in its docstring) and is
registered under SGLang's own name, ``torch.ops.sgl_kernel.<op>``, so SGLang's code calls it unchanged.
"""

from __future__ import annotations

import ctypes

import torch

_LIB = torch.library.Library("sgl_kernel", "FRAGMENT")


def register(schema: str):
    """Define ``sgl_kernel::<op>`` with ``schema`` and make ``fn`` its CPU kernel (unless one exists)."""
    name = schema.split("(", 1)[0]

    def add(fn):
        try:
            _LIB.define(schema)
        except RuntimeError:  # a real CPU build registered it first: keep the real kernel
            return fn
        _LIB.impl(name, fn, "CPU")
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        return fn

    return add


@register("copy_all_layer_kv_cache_cpu(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()")
def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """``copy_all_layer_kv_cache_tiled`` (sglang/kernels/ops/kvcache/cache_move.py): in every buffer
    ``b`` (base address ``data_ptrs[b]``, row size ``strides[b]`` bytes), row ``tgt_loc[i]`` becomes
    row ``src_loc[i]``. All rows are read before any is written, so overlapping moves are safe."""
    src = [int(x) for x in src_loc.tolist()]
    tgt = [int(x) for x in tgt_loc.tolist()]
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = [ctypes.string_at(base + s * stride, stride) for s in src]
        for t, row in zip(tgt, rows):
            ctypes.memmove(base + t * stride, row, stride)
