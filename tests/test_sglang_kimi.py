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

from eagle3_assets.drafter import sglang_acceptance
from eagle3_assets.target.sglang_server import SGLangServer
from eagle3_assets.testing import small_drafter

pytestmark = [pytest.mark.sglang, pytest.mark.model, pytest.mark.usefixtures("one_torch_thread")]

K = 3
MAX_NEW = 16
PROMPTS = small_drafter.HELD_OUT[:4]


@pytest.fixture(scope="module")
def kimi(kimi_mini_dir):
    from eagle3_assets.target.embedded import EmbeddedModel
    from eagle3_assets.tokens.tokenizer import TargetTokenizer

    return EmbeddedModel(kimi_mini_dir, tokenizer=TargetTokenizer.load(kimi_mini_dir, trust_remote_code=True))


@pytest.fixture(scope="module")
def mla_export(kimi, kimi_mini_dir, tmp_path_factory):
    """A kimi-mini MLA drafter trained on the target's own greedy answers, exported for SGLang in float32."""
    from eagle3_assets.drafter.export import export_sglang

    out = tmp_path_factory.mktemp("mla")
    features = small_drafter.answer_features(kimi, kimi_mini_dir, out / "features", small_drafter.TRAIN_QUESTIONS,
                                             max_new_tokens=MAX_NEW)
    model = small_drafter.train_on_features(features, kimi_mini_dir, out / "train", k=K, attention="mla")
    return export_sglang(model, out / "sglang", dtype="float32")  # the MLA-draft requirement is checked here


@pytest.fixture(scope="module")
def spec_server(kimi_mini_dir, mla_export, tmp_path_factory):
    server = SGLangServer(kimi_mini_dir, attention_backend="intel_amx", drafter_dir=mla_export, speculative_steps=K,
                          workdir=tmp_path_factory.mktemp("sglang-kimi"))
    assert "--trust-remote-code" in server.command()
    with server:
        yield server


def test_sglang_serves_kimi_mini_with_the_mla_drafter_and_its_counters_equal_the_project(spec_server, mla_export,
                                                                                        kimi, kimi_mini_dir):
    from eagle3_assets.drafter.export import load_sglang
    from eagle3_assets.drafter.spec_decode import evaluate_acceptance, greedy_generate
    from eagle3_assets.drafter.target_weights import read_target_embeddings

    log = spec_server.log_path.read_text(errors="replace")
    assert "type=KimiK25ForConditionalGeneration" in log and "type=Eagle3DeepseekV2ForCausalLM" in log
    prompts = [kimi.render_prompt([{"role": "user", "content": q}]) for q in PROMPTS]
    greedy = [greedy_generate(kimi.model, p, max_new_tokens=MAX_NEW, stop_ids=kimi.stop_ids) for p in prompts]
    engine = sglang_acceptance.measure_acceptance(spec_server.base_url, prompts, k=K, max_new_tokens=MAX_NEW,
                                                  greedy_reference=greedy, stop_token_ids=kimi.stop_ids)
    drafter = load_sglang(mla_export, read_target_embeddings(kimi_mini_dir)).float().eval()
    assert drafter.config.attention == "mla"
    project = evaluate_acceptance(kimi.model, drafter, prompts, k=K, max_new_tokens=MAX_NEW, stop_ids=kimi.stop_ids,
                                  greedy_reference=greedy)
    figures = sglang_acceptance.compare(project.as_metadata(), engine)
    print("kimi-mini MLA drafter acceptance:", json.dumps(figures))
    assert engine.matches_greedy, (engine.outputs, greedy)
    assert project.matches_greedy, figures
    assert engine.drafts > 0 and engine.draft_tokens == K * engine.drafts, figures
    assert engine.acceptance_length > 1.05, figures  # trained: not a trivial 1.0 vs 1.0
    accepted = sum(j * n for j, n in enumerate(project.accepted_histogram))
    assert (engine.drafts, engine.accepted_tokens) == (project.verify_steps, accepted), figures
    assert engine.per_position_rate == pytest.approx(project.per_position_rate, abs=1e-9), figures
