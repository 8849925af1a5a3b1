"""The in-process capture on SGLang's real ``ModelRunner`` (tests marked sglang): SGLang 0.5.23's
CPU engine from ``.venv-sglang`` loads the SmolLM2 target, the capture swaps its logits processor
for the capture head, and the aux and final states of a small corpus match the local extractor's
token for token. One rank, one batch, float32 on both sides.

Tolerance: per token, the largest difference is at most 2**-8 (bfloat16's relative step) of that
token's largest magnitude. Measured on 2026-12-03 (this corpus): max abs difference 1.2e-4 on the
aux states (worst per-token relative 2.7e-7) and 2.5e-5 on the final states (1.4e-6), far inside it.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from eagle3_assets.engines.local.extractor import LocalExtractor
from eagle3_assets.engines.sglang.cpu import server_environment
from eagle3_assets.engines.sglang.server import default_python
from eagle3_assets.engines.vllm.server import PACKAGE_PARENT

pytestmark = [pytest.mark.sglang, pytest.mark.model]
LAYERS = [1, 14, 27]
TEXTS = ["The capital of France is Paris.", "def add(a, b):\n    return a + b",
         "Write a haiku about the sea and the wind over the harbour at night."]
BF16_STEP = 2.0 ** -8


def run_capture(tmp_path, name: str, spec: dict) -> dict:
    (tmp_path / f"{name}.json").write_text(json.dumps(spec))
    env = server_environment()
    env["PYTHONPATH"] += os.pathsep + str(PACKAGE_PARENT)
    env.update({"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    out = subprocess.run([default_python(), "-m", "eagle3_assets.engines.sglang.cpu.run_capture",
                          str(tmp_path / f"{name}.json"), str(tmp_path / f"{name}.pt")],
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return torch.load(tmp_path / f"{name}.pt")


@pytest.fixture(scope="module")
def rows(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(t)["input_ids"] for t in TEXTS]


def test_the_real_model_runner_captures_what_the_local_extractor_extracts(model_dir, rows, tmp_path,
                                                                          one_torch_thread):
    got = run_capture(tmp_path, "capture", {"model": str(model_dir), "layer_ids": LAYERS, "rows": rows})
    assert got["layers_to_capture"] == [k + 1 for k in LAYERS]
    n = sum(map(len, rows))
    assert got["aux"].shape == (n, 3 * 576) and got["last"].shape == (n, 576)
    feats = LocalExtractor(model_dir, layer_ids=LAYERS).extract(rows)
    for name in ("aux", "last"):
        local = torch.cat([getattr(f, name) for f in feats]).float()
        diff = (got[name].float() - local).abs().amax(dim=1)
        scale = local.abs().amax(dim=1)
        worst = (diff / scale).max().item()
        print(f"{name}: max abs diff {diff.max().item():.3g}, worst per-token relative {worst:.3g}")
        assert (diff <= BF16_STEP * scale).all(), f"{name}: worst per-token relative difference {worst}"
    assert torch.isfinite(got["aux"]).all() and torch.isfinite(got["last"]).all()


def test_a_fixed_pool_too_small_for_the_longest_row_is_refused_on_the_real_server_args(model_dir, rows, tmp_path):
    got = run_capture(tmp_path, "small", {"model": str(model_dir), "layer_ids": LAYERS, "rows": rows,
                                          "server_args": {"max_total_tokens": 8}})
    need = sum(map(len, rows))
    assert got["refused"].startswith("server_args max_total_tokens 8 cannot hold the longest row")
    assert f"it needs {need}" in got["refused"]
