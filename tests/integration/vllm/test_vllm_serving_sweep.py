"""The serving benchmark's sweep in a real vLLM (``.venv-vllm``): the target alone and a drafter trained
here at a chain of 3, at concurrency 1 and 2, on two bundled math prompts. Outputs must equal
transformers' greedy decoding, and vLLM's ``/metrics`` counters over the concurrency-1 batch must
count exactly the project's evaluator's verification steps and accepted tokens. Two server starts
(about 70 s each on 2 idle cores) are most of its time."""

from __future__ import annotations

import pytest

from tests.support import serving_check

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.usefixtures("one_torch_thread")]


def test_a_tiny_sweep_agrees_with_greedy_decoding_and_the_project_evaluator(embedded, model_dir, smol_drafter,
                                                                               tmp_path):
    from eagle3_assets.drafter import formats
    from eagle3_assets.drafter.target_weights import read_target_embeddings

    export = smol_drafter / "vllm"  # the session's small drafter (tests/support/shared_drafters.py), k=3
    assert serving_check.K == 3
    result = serving_check.tiny_sweep("vllm", embedded, model_dir, export.parent, tmp_path)
    drafter = formats.load("vllm", export, read_target_embeddings(model_dir)).float().eval()
    greedy, project = serving_check.independent_records(embedded, model_dir, drafter, result["bench"])
    serving_check.assert_sweep_agrees(result, greedy, project)
