"""The project's CPU versions of the sgl_kernel ops SGLang's EAGLE-3 worker calls on a CPU
(engines/sglang/cpu/hook), each against SGLang's own definition (marked sglang: SGLang's Triton
kernels run by Triton's interpreter, its torch-native attention; see tests/support/sglang_ops_reference.py),
plus the one op that has no GPU twin, checked against the semantics of sgl-kernel's spec.cpp."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3_assets.engines.sglang.cpu import HOOK_DIR, server_environment
from eagle3_assets.engines.sglang.server import default_python

ROOT = Path(__file__).resolve().parents[3]
REFERENCED = ["assign_extend_cache_locs_cpu", "assign_req_to_token_pool_cpu", "assign_draft_cache_locs_contiguous_cpu",
              "fill_bonus_tokens_cpu", "fill_accept_out_cache_loc_cpu", "rotate_input_ids_cpu",
              "build_tree_kernel_efficient_cpu mode 1", "build_tree_kernel_efficient_cpu mode 0",
              "verify_tree_greedy_cpu trial 0", "verify_tree_greedy_cpu trial 1", "verify_tree_greedy_cpu trial 2",
              "verify_tree_greedy_cpu trial 3", "extend_attention_cpu", "extend_attention_cpu mla prefill",
              "decode_attention_cpu"]


def _load(name: str):
    sys.path.insert(0, str(HOOK_DIR))
    try:
        spec = importlib.util.spec_from_file_location(name, HOOK_DIR / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(HOOK_DIR))


@pytest.mark.sglang
def test_each_op_equals_sglangs_own_definition():
    env = server_environment({**os.environ, "PYTHONPATH": str(ROOT)})
    env.update({"TRITON_INTERPRET": "1", "SGLANG_USE_CPU_ENGINE": "1"})
    out = subprocess.run([default_python(), str(ROOT / "tests" / "support" / "sglang_ops_reference.py")], env=env,
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [line[3:] for line in out.stdout.splitlines() if line.startswith("ok ")] == REFERENCED


def test_build_draft_decode_metadata_rows_are_prefix_then_the_candidates_slots():
    """spec.cpp: row ``b*topk+k`` = request b's first ``seq_len`` slots, then the ``num_steps`` slots
    candidate k's drafts were given at ``seq_len + k*num_steps`` (assign_draft_cache_locs_contiguous)."""
    _load("sgl_kernel_spec_ops")
    pool_len, topk, steps = 20, 2, 3
    rtt = torch.arange(3 * pool_len, dtype=torch.int32).view(3, pool_len) + 100
    out = torch.ops.sgl_kernel.build_draft_decode_metadata_cpu(rtt, torch.tensor([2, 0]), torch.tensor([4, 7]), topk,
                                                               steps, pool_len)
    assert out.shape == (4, pool_len) and out.dtype == torch.int32
    row2 = rtt[2].tolist()
    assert out[0, :7].tolist() == row2[:4] + row2[4:7]
    assert out[1, :7].tolist() == row2[:4] + row2[7:10]
    row0 = rtt[0].tolist()
    assert out[3, :10].tolist() == row0[:7] + row0[10:13]
