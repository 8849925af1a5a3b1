"""The serving benchmark's sweep in a real SGLang (``.venv-sglang``, its CPU engine with the project's
kernels): the target alone and a drafter trained here at a chain of 3, at concurrency 1 and 2, on two
bundled math prompts. Outputs must equal transformers' greedy decoding, and the per-request counters
SGLang streams must count exactly the project's evaluator's verification steps and accepted tokens
at concurrency 1. Two server starts (60-80 s each on 2 idle cores) are most of its time."""

from __future__ import annotations

import pytest

from tests.support import serving_check

pytestmark = [pytest.mark.sglang, pytest.mark.model]


def test_a_tiny_sweep_agrees_with_greedy_decoding_and_the_project_evaluator(embedded, model_dir, smol_drafter,
                                                                               tmp_path, one_torch_thread):
    from eagle3_assets.drafter import formats
    from eagle3_assets.drafter.target_weights import read_target_embeddings

    export = smol_drafter / "sglang"  # the session's small drafter (tests/support/shared_drafters.py), k=3
    assert serving_check.K == 3
    result = serving_check.tiny_sweep("sglang", embedded, model_dir, smol_drafter, tmp_path)
    drafter = formats.load("sglang", export, read_target_embeddings(model_dir)).float().eval()
    greedy, project = serving_check.independent_records(embedded, model_dir, drafter, result["bench"])
    serving_check.assert_sweep_agrees(result, greedy, project)
