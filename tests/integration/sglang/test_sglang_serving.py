"""SGLang's own EAGLE-3 worker, for real (marked sglang): a server from ``.venv-sglang`` running the real
SmolLM2 target on SGLang's CPU engine with the ``intel_amx`` attention backend (its only CPU backend
with a multi-step draft backend; the kernels are the project's plain-torch ones, engines/sglang/cpu),
speculating with the SGLang export (``LlamaForCausalLMEagle3``) of a drafter trained here.

Output must equal the target's greedy decoding, and the acceptance SGLang counts per request
(``spec_verify_ct``, ``spec_num_correct_drafts``, ...) must equal the project's evaluator's on the
same float32 weights: same verification steps, same accepted tokens. Scale: 4 held-out prompts (2 for the tree),
replies of at most 16 tokens, a drafter trained for 40 steps on 16 answers.
"""

from __future__ import annotations

import json

import pytest

from eagle3_assets.engines.sglang import acceptance as sglang_acceptance
from eagle3_assets.engines.sglang.server import SGLangServer
from tests.support import small_drafter

pytestmark = [pytest.mark.sglang, pytest.mark.model]

K = 3
MAX_NEW = 16
PROMPTS = small_drafter.HELD_OUT[:4]


@pytest.fixture(scope="module")
def sglang_export(smol_drafter, one_torch_thread):
    """A small drafter trained on the target's own greedy answers, exported for SGLang in float32
    (the session's, tests/support/shared_drafters.py)."""
    return smol_drafter / "sglang"


@pytest.fixture(scope="module")
def spec_server(model_dir, sglang_export, tmp_path_factory):
    with SGLangServer(model_dir, attention_backend="intel_amx", drafter_dir=sglang_export, speculative_steps=K,
                      workdir=tmp_path_factory.mktemp("sglang-spec")) as server:
        yield server


def served_vs_project(base_url: str, embedded, model_dir, export, prompts):
    """The export's acceptance by SGLang's counters and by the project's evaluator on the weights
    SGLang loaded, both against the target's greedy decoding: ``(engine, project, figures, settle)``,
    ``settle()`` listing the evaluator's counts under each settling of its near-ties."""
    from eagle3_assets.drafter import formats
    from eagle3_assets.drafter.spec_decode import evaluate_acceptance, greedy_generate
    from eagle3_assets.drafter.target_weights import read_target_embeddings

    stop = embedded.stop_ids
    greedy = [greedy_generate(embedded.model, p, max_new_tokens=MAX_NEW, stop_ids=stop) for p in prompts]
    engine = sglang_acceptance.measure_acceptance(base_url, prompts, k=K, max_new_tokens=MAX_NEW,
                                                  greedy_reference=greedy, stop_token_ids=stop)
    drafter = formats.load("sglang", export, read_target_embeddings(model_dir)).float().eval()
    project = evaluate_acceptance(embedded.model, drafter, prompts, k=K, max_new_tokens=MAX_NEW, stop_ids=stop,
                                  greedy_reference=greedy)

    def settle():
        return small_drafter.settled_counts(embedded.model, drafter, prompts, k=K, max_new_tokens=MAX_NEW, stop_ids=stop)

    return engine, project, sglang_acceptance.compare(project.as_metadata(), engine), settle


def assert_same_acceptance(engine, project, figures, settle) -> None:
    """Both decode greedily and SGLang counts the project's steps and accepted tokens at each draft
    position exactly, or, where the evaluator met a near-tie, as one settling of it does."""
    assert engine.matches_greedy, (engine.outputs, figures)
    assert project.matches_greedy, figures
    assert engine.drafts > 0 and engine.draft_tokens == K * engine.drafts, figures
    assert engine.acceptance_length > 1.05, figures  # trained: not a trivial 1.0 vs 1.0
    counts = small_drafter.acceptance_counts(engine, project, "sglang")
    how = small_drafter.assert_counts_agree(counts["sglang"], counts["project"], project, settle)
    print("SGLang's counts equal the evaluator's:", how, json.dumps(counts))


def test_sglang_eagle3_output_is_greedy_and_its_counters_equal_the_project_evaluator(spec_server, sglang_export,
                                                                                      embedded, model_dir):
    prompts = [embedded.render_prompt([{"role": "user", "content": q}]) for q in PROMPTS]
    engine, project, figures, settle = served_vs_project(spec_server.base_url, embedded, model_dir, sglang_export,
                                                         prompts)
    print("acceptance:", json.dumps(figures))
    assert_same_acceptance(engine, project, figures, settle)


@pytest.fixture(scope="module")
def tree_server(model_dir, sglang_export, tmp_path_factory):
    with SGLangServer(model_dir, attention_backend="intel_amx", drafter_dir=sglang_export, speculative_steps=K,
                      speculative_topk=2, speculative_draft_tokens=6,
                      workdir=tmp_path_factory.mktemp("sglang-tree")) as server:
        yield server


def test_sglang_verifies_a_draft_tree_and_stays_greedy(tree_server, embedded):
    """Top-k 2, 6 nodes a step: SGLang's worker drafts a tree, verifies it in one extend under its tree
    mask (the project's ``extend_attention_cpu`` with ``custom_mask``) and accepts a root-to-leaf path,
    and the output stays greedy. That alone does not prove the mask: with this small drafter the
    output was unchanged with the mask ignored, so the mask itself is checked op-level against
    torch's attention over each node's ancestors (tests/unit/engines/test_sglang_cpu_support.py)."""
    from eagle3_assets.drafter.spec_decode import greedy_generate

    # two prompts: each tree step runs the project's per-sequence CPU ops, about 30 s a prompt here
    prompts = [embedded.render_prompt([{"role": "user", "content": q}]) for q in PROMPTS[:2]]
    greedy = [greedy_generate(embedded.model, p, max_new_tokens=MAX_NEW, stop_ids=embedded.stop_ids) for p in prompts]
    engine = sglang_acceptance.measure_acceptance(tree_server.base_url, prompts, k=K, max_new_tokens=MAX_NEW,
                                                  greedy_reference=greedy, stop_token_ids=embedded.stop_ids)
    print("tree acceptance:", engine.acceptance_length, engine.drafts, engine.accepted_tokens)
    assert "'speculative_eagle_topk': 2" in tree_server.log_path.read_text(errors="replace")
    assert engine.matches_greedy, (engine.outputs, greedy)
    assert engine.drafts > 0 and engine.draft_tokens == 5 * engine.drafts  # 6 nodes: the root and 5 drafts
    assert engine.acceptance_length > 1.05
