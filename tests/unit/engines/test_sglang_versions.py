"""The MLA drafter's SGLang requirement (REQUIREMENTS["mla_draft"] in engines/sglang/versions.py), checked where an
MLA drafter is exported for SGLang and where an SGLang server is asked to serve one."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3_assets.engines.sglang import versions as engines
from eagle3_assets.engines.sglang.server import SGLangServer, serving_problem
from eagle3_assets.engines.sglang.versions import SGLANG_VERSION
from eagle3_assets.engines.versions import EngineVersionError, mla_draft_problem

MLA_TARGET = {"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2", "kv_lora_rank": 512}}


def _write(path, config):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_the_requirement_names_the_first_release_with_the_mla_draft():
    assert mla_draft_problem("sglang", SGLANG_VERSION) is None
    assert "0.5.12" in mla_draft_problem("sglang", "0.5.11") and "Eagle3DeepseekV2ForCausalLM" in mla_draft_problem(
        "sglang", "0.5.11")


def test_an_mla_export_for_sglang_is_refused_when_the_supported_sglang_lacks_the_draft(tmp_path, monkeypatch):
    from eagle3_assets.drafter import formats
    from eagle3_assets.drafter.model import DrafterConfig, build_drafter

    target = {**MLA_TARGET["text_config"], "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
              "num_hidden_layers": 8, "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 8,
              "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 128}
    cfg = DrafterConfig.from_target(target, draft_vocab_size=32, intermediate_size=32, attention="mla")
    model = build_drafter(cfg, torch.randn(64, 16), seed=0)
    assert (formats.export("sglang", model, tmp_path / "ok", dtype="float32") / "config.json").exists()
    monkeypatch.setattr(engines, "SGLANG_VERSION", "0.5.11")
    with pytest.raises(EngineVersionError, match="cannot export an MLA drafter for SGLang: SGLang 0.5.11"):
        formats.export("sglang", model, tmp_path / "old", dtype="float32")
    assert not (tmp_path / "old").exists()


def test_serving_checks_the_mla_requirement_and_the_pairing(tmp_path):
    target = _write(tmp_path / "target", MLA_TARGET)
    mla = _write(tmp_path / "mla", {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "q_lora_rank": 8})
    assert serving_problem(SGLANG_VERSION, target, mla) is None
    assert "arrived in 0.5.12" in serving_problem("0.5.11", target, mla)
    no_q = _write(tmp_path / "no_q", {"architectures": ["Eagle3DeepseekV2ForCausalLM"]})
    assert "requires q_lora_rank" in serving_problem(SGLANG_VERSION, target, no_q)
    llama_target = _write(tmp_path / "llama", {"model_type": "llama"})
    assert "needs an MLA target" in serving_problem(SGLANG_VERSION, llama_target, mla)


def test_a_server_refuses_an_unservable_drafter_before_it_starts(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho {SGLANG_VERSION}\n")
    fake.chmod(0o755)
    target = _write(tmp_path / "target", MLA_TARGET)
    no_q = _write(tmp_path / "no_q", {"architectures": ["Eagle3DeepseekV2ForCausalLM"]})
    server = SGLangServer(target, python=str(fake), drafter_dir=no_q, workdir=tmp_path / "w")
    with pytest.raises(EngineVersionError, match="requires q_lora_rank"):
        server.start()
    assert server._proc is None and not (tmp_path / "w").exists()
