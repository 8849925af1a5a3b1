"""Kimi-K2.5's path through SGLang's own EAGLE-3 worker (marked sglang): kimi-mini served by SGLang's
``KimiK25ForConditionalGeneration`` (K2.5's class: the DeepSeek-V3 language model with MLA attention
and routed experts behind the vision wrapper) on SGLang's CPU engine, speculating with the SGLang
export of a kimi-mini MLA drafter (``Eagle3DeepseekV2ForCausalLM``, loaded by SGLang as its
``kimi_k25_eagle3`` draft model).

On this CPU the target's prefill runs DeepSeek's MHA path (full-head keys through
``extend_attention_cpu``), its decode and verify the absorbed MLA path over the latent cache
(512 + 64), and the drafter the same. Output must equal transformers' greedy decoding, and SGLang's
per-request counters must equal the project's evaluator on the same float32 weights. Scale: 4
held-out prompts, replies of at most 16 tokens, a drafter trained 40 steps on 16 answers; K2.5
differs in size (61 layers, hidden 7,168, TP 8 on GPUs), not in the classes and counters checked.
"""

from __future__ import annotations

import json

import pytest

from eagle3_assets.engines.sglang.server import SGLangServer
from tests.integration.sglang.test_sglang_serving import MAX_NEW, K, assert_same_acceptance, served_vs_project
from tests.support import small_drafter

pytestmark = [pytest.mark.sglang, pytest.mark.model, pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = small_drafter.HELD_OUT[:4]


@pytest.fixture(scope="module")
def kimi(kimi_embedded):
    return kimi_embedded


@pytest.fixture(scope="module")
def mla_export(kimi_mla_drafter):
    """A kimi-mini MLA drafter trained on the target's own greedy answers (up to MAX_NEW tokens),
    exported for SGLang in float32 (the session's, tests/support/shared_drafters.py, whose export
    checks the MLA-draft requirement)."""
    from tests.support.shared_drafters import KIMI_MAX_NEW

    assert (KIMI_MAX_NEW, K) == (MAX_NEW, 3)
    return kimi_mla_drafter / "sglang"


@pytest.fixture(scope="module")
def spec_server(kimi_mini_dir, mla_export, tmp_path_factory):
    server = SGLangServer(kimi_mini_dir, attention_backend="intel_amx", drafter_dir=mla_export, speculative_steps=K,
                          workdir=tmp_path_factory.mktemp("sglang-kimi"))
    assert "--trust-remote-code" in server.command()
    with server:
        yield server


def test_sglang_serves_kimi_mini_with_the_mla_drafter_and_its_counters_equal_the_project(spec_server, mla_export,
                                                                                        kimi, kimi_mini_dir):
    assert json.loads((mla_export / "config.json").read_text())["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    log = spec_server.log_path.read_text(errors="replace")
    assert "type=KimiK25ForConditionalGeneration" in log and "type=Eagle3DeepseekV2ForCausalLM" in log
    prompts = [kimi.render_prompt([{"role": "user", "content": q}]) for q in PROMPTS]
    engine, project, figures, settle = served_vs_project(spec_server.base_url, kimi, kimi_mini_dir, mla_export, prompts)
    print("kimi-mini MLA drafter acceptance:", json.dumps(figures))
    assert_same_acceptance(engine, project, figures, settle)
