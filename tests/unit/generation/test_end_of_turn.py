"""Every decode loop stops at the end of a turn, not only on ``eos_token_id``: on kimi-mini they differ.

kimi-mini follows Kimi-K2.5: ``eos_token_id`` 163585 (``[EOS]``) in its config and generation
config, while its template ends every turn with ``<|im_end|>`` (163586), and never ``[EOS]``. A
loop that stopped on ``eos_token_id`` alone would run on past the turn: these tests decode the
stand-in for real and fail if any loop does. Its random weights rarely choose ``<|im_end|>`` by
themselves, so the loaded copy's head row for it is pointed at the token its replies write most:
each turn then ends where the model would first have written that token.
"""

import json

import pytest

from eagle3_assets.target.spec import TargetSpec

pytestmark = pytest.mark.model
EOS, IM_END = 163585, 163586
QUESTIONS = ["Name a color.", "Name a fruit.", "Hello", "What is 2+3?", "Say hi."]
# Long enough to show a loop stopping on eos_token_id alone running past the turn: on this stand-in
# each turn ends at the reply's first token (recorded on all five questions), the eos-only decoding
# then runs to the limit.
MAX_NEW = 16


@pytest.fixture(scope="module")
def spec(kimi_mini_dir):
    return TargetSpec(kimi_mini_dir, trust_remote_code=True)


def end_turns_early(lm, spec) -> None:
    """Point the head row of ``<|im_end|>`` at the token greedy replies write most (in memory)."""
    import collections

    import torch

    from eagle3_assets.drafter.spec_decode import greedy_generate

    written = collections.Counter()
    for p in prompts(spec):
        written.update(greedy_generate(lm, p, max_new_tokens=24, stop_ids=[EOS])[2:])
    token = written.most_common(1)[0][0]
    with torch.no_grad():
        lm.lm_head.weight[IM_END] = lm.lm_head.weight[token] * 1.01


@pytest.fixture(scope="module")
def target(spec):
    from eagle3_assets.target.loading import load_causal_lm

    lm = load_causal_lm(spec.model_dir)
    end_turns_early(lm, spec)
    return lm


def prompts(spec):
    tok = spec.load_tokenizer()
    return [tok.render_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]


def test_kimi_mini_declares_k25s_eos_and_every_stop_set_holds_the_turn_end(spec):
    from eagle3_assets.drafter.vllm_acceptance import _stop_ids

    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((spec.model_dir / name).read_text())
        assert cfg["eos_token_id"] == EOS and cfg.get("text_config", {"eos_token_id": EOS})["eos_token_id"] == EOS
    assert spec.load_tokenizer().end_of_turn_id == IM_END
    assert spec.stop_token_ids() == [EOS, IM_END]  # the drafter's evaluation
    assert _stop_ids(spec.model_dir, trust_remote_code=True) == [EOS, IM_END]  # the vLLM acceptance run


def test_greedy_and_speculative_decoding_stop_at_the_end_of_turn(spec, target):
    from eagle3_assets.drafter.model import DrafterConfig, build_drafter
    from eagle3_assets.drafter.spec_decode import greedy_generate, speculative_generate
    from eagle3_assets.drafter.target_weights import read_target_embeddings
    from eagle3_assets.drafter.vocab_map import build_vocab_map

    stops, n = spec.stop_token_ids(), MAX_NEW
    ended = 0
    for p in prompts(spec):
        out = greedy_generate(target, p, max_new_tokens=n, stop_ids=stops)
        eos_only = greedy_generate(target, p, max_new_tokens=n, stop_ids=[EOS])
        if IM_END in eos_only:  # the turn ended: only the full stop set ends the decoding there
            ended += 1
            cut = eos_only.index(IM_END) + 1
            assert out == eos_only[:cut] and len(eos_only) > cut
        else:
            assert out == eos_only
    assert ended >= 3, f"the stand-in should end most of these turns within {n} tokens"

    import torch

    counts = torch.zeros(spec.text_config["vocab_size"], dtype=torch.long)
    counts[:4096] = 1
    vmap = build_vocab_map(counts, 256)
    dcfg = DrafterConfig.from_target(spec.config, draft_vocab_size=256, intermediate_size=64)
    drafter = build_drafter(dcfg, read_target_embeddings(spec.model_dir), vmap, seed=0).float().eval()
    for p in prompts(spec)[:2]:
        res = speculative_generate(target, drafter, p, k=3, max_new_tokens=n, stop_ids=stops)
        assert res.output_ids == greedy_generate(target, p, max_new_tokens=n, stop_ids=stops)
        assert IM_END not in res.output_ids[:-1]


def test_local_generation_and_its_rows_end_at_the_turn(spec):
    from eagle3_assets.target.embedded import EmbeddedModel

    model = EmbeddedModel(spec.model_dir, tokenizer=spec.load_tokenizer())
    assert set(model.stop_ids) == {EOS, IM_END}
    end_turns_early(model.model, spec)
    outs = model.generate(prompts(spec), max_new_tokens=MAX_NEW)
    stopped = [g for g in outs if g.finish_reason == "stop"]
    assert len(stopped) >= 3 and all(g.output_ids[-1] == IM_END and IM_END not in g.output_ids[:-1] for g in stopped)
