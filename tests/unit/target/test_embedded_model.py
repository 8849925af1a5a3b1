import pytest

from eagle3_assets.target.embedded import ensure_default_model

pytestmark = pytest.mark.model


def test_conversion_is_cached_and_loadable(model_dir):
    assert (model_dir / "model.safetensors").exists() and (model_dir / "chat_template.jinja").exists()
    assert "quantization_config" not in (model_dir / "config.json").read_text()
    assert ensure_default_model(model_dir.parent) == model_dir  # second call reuses the cache


def test_batched_greedy_matches_batch_of_one_and_keeps_stop_token(embedded):
    prompts = [embedded.render_prompt([{"role": "user", "content": q}])
               for q in ("What is 2+3? Answer with a number only.", "Name the capital of France in one word.")]
    batched = embedded.generate(prompts, max_new_tokens=16)
    single = [embedded.generate([p], max_new_tokens=16)[0] for p in prompts]
    assert [g.output_ids for g in batched] == [g.output_ids for g in single]
    for g in batched:
        if g.finish_reason == "stop":
            assert g.output_ids[-1] in embedded.stop_ids
        else:
            assert len(g.output_ids) == 16


def test_sampling_is_reproducible_with_a_seed(embedded):
    p = [embedded.render_prompt([{"role": "user", "content": "Write a word about the sea."}])]
    a = embedded.generate(p, max_new_tokens=12, temperature=1.0, seed=7)[0].output_ids
    b = embedded.generate(p, max_new_tokens=12, temperature=1.0, seed=7)[0].output_ids
    others = {tuple(embedded.generate(p, max_new_tokens=12, temperature=1.0, seed=s)[0].output_ids) for s in range(3)}
    assert a == b and len(others) > 1
