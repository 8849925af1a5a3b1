"""EAGLE 3.1 drafters served by SGLang's own EAGLE-3 worker (marked sglang): one drafter of each kind
trained once per session (shared with the vLLM tests of 3.1) with both switches on (``fc_norm``,
``norm_output``), exported for SGLang and served on its CPU engine; SGLang's per-request counters must
equal the project's evaluator step for step, as for the 3.0 drafters of ``test_sglang_serving.py``
(SmolLM2, ``LlamaForCausalLMEagle3``) and ``test_sglang_kimi.py`` (kimi-mini,
``Eagle3DeepseekV2ForCausalLM``), or, only where the evaluator met a near-tie, as it counts with that
settled the other way (the MLA drafter's one, as in the vLLM tests of 3.1). Had SGLang ignored a
switch, it would run another network than the evaluator and the counts would part beyond any
near-tie. Each server lives for its test alone.

Scale: the 3.0 tests' (4 held-out prompts, replies of at most 16 tokens, 40 training steps on the
answers the 3.0 drafter of the same target trained on).
"""

from __future__ import annotations

import json

import pytest

from eagle3_assets.engines.sglang.server import SGLangServer
from tests.integration.sglang.test_sglang_serving import PROMPTS, K, assert_same_acceptance, served_vs_project

pytestmark = [pytest.mark.sglang, pytest.mark.model, pytest.mark.usefixtures("one_torch_thread")]


def counts_agree(target_dir, embedded, export, tmp_path_factory) -> None:
    c = json.loads((export / "config.json").read_text())
    assert (c["fc_norm"], c["norm_output"]) == (True, True)
    prompts = [embedded.render_prompt([{"role": "user", "content": q}]) for q in PROMPTS]
    with SGLangServer(target_dir, attention_backend="intel_amx", drafter_dir=export, speculative_steps=K,
                      workdir=tmp_path_factory.mktemp("s31")) as server:
        engine, project, figures, settle = served_vs_project(server.base_url, embedded, target_dir, export, prompts)
    print(f"EAGLE 3.1 {c['architectures']} acceptance:", json.dumps(figures))
    assert_same_acceptance(engine, project, figures, settle)


# The drafters are the session's (tests/support/shared_drafters.py), shared with the vLLM tests of
# EAGLE 3.1: a chain of 3, both switches on, trained 40 steps on the target's answers to TRAIN_QUESTIONS.
def test_sglang_counts_a_llama_style_eagle31_drafter_as_the_project_does(embedded, model_dir, smol_drafter_31,
                                                                         tmp_path_factory):
    assert K == 3
    counts_agree(model_dir, embedded, smol_drafter_31 / "sglang", tmp_path_factory)


def test_sglang_counts_an_mla_eagle31_drafter_as_the_project_does(kimi_mini_dir, kimi_embedded, kimi_mla_drafter_31,
                                                                  tmp_path_factory):
    counts_agree(kimi_mini_dir, kimi_embedded, kimi_mla_drafter_31 / "sglang", tmp_path_factory)


def test_the_modules_named_as_reading_the_switches_read_them_in_the_installed_sglang():
    from eagle3_assets.engines.sglang.server import default_python
    from tests.support.engine_source import unread

    assert unread(default_python(), "sglang") == []
