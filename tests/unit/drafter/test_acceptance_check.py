"""drafter_acceptance's two decisions without a model: the acceptance bar (floor, margin over the
untrained twin, the recipe's figures in eval.json) and the export's aux layers against training."""

import json

import pytest

from eagle3_assets.drafter.checks import acceptance_problems
from eagle3_assets.drafter.trained_layers import export_layer_problems, layer_id_problems, trained_layers
from eagle3_assets.drafter.training.config import EvalSettings
from eagle3_assets.target.layers import convention


def _eval(trained: float, untrained: float, settings: EvalSettings, greedy: bool = True) -> dict:
    return {"trained": {"acceptance_length": trained, "matches_greedy": greedy},
            "untrained": {"acceptance_length": untrained, "matches_greedy": True},
            "floor": settings.acceptance_floor, "margin": settings.acceptance_margin}


def test_an_untrained_drafter_fails_the_default_recipe():
    default = EvalSettings()
    # an untrained drafter accepts nothing: acceptance length 1.000 (measured on both test graphs)
    problems = acceptance_problems(_eval(1.0, 1.0, default), default)
    assert problems == [f"acceptance length 1.000 is below the floor {default.acceptance_floor}",
                        f"acceptance length 1.000 does not beat the untrained drafter's 1.000 by the margin "
                        f"{default.acceptance_margin}"]


def test_the_margin_is_over_the_untrained_twin_not_over_one():
    s = EvalSettings(acceptance_floor=1.1, acceptance_margin=0.2)
    assert acceptance_problems(_eval(1.5, 1.2, s), s) == []
    [problem] = acceptance_problems(_eval(1.35, 1.2, s), s)  # above the floor, not clear of the twin
    assert "does not beat the untrained drafter's 1.200 by the margin 0.2" in problem
    assert acceptance_problems(_eval(1.5, 1.2, s, greedy=False), s) == [
        "speculative decoding did not reproduce greedy decoding"]


def test_eval_json_must_carry_the_recipes_floor_and_margin():
    measured, now = EvalSettings(acceptance_floor=1.0, acceptance_margin=0.01), EvalSettings()
    [problem] = acceptance_problems(_eval(2.0, 1.0, measured), now)
    assert "measured against floor 1.0 and margin 0.01, the recipe states floor 1.1 and margin 0.1" in problem


def test_a_recipe_cannot_state_no_margin():
    with pytest.raises(ValueError):
        EvalSettings(acceptance_margin=0.0)


def _drafter_dir(tmp_path, ids: list[int], n_layers: int = 30):
    shards = tmp_path / "hs"
    shards.mkdir()
    (shards / "manifest.json").write_text(json.dumps({"layers": convention(ids, n_layers)}))
    out = tmp_path / "drafter"
    for engine, key, cfg_ids in (("sglang", None, ids), ("vllm", "eagle_aux_hidden_state_layer_ids", [i + 1 for i in ids])):
        (out / engine).mkdir(parents=True)
        cfg = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": cfg_ids}}
        if key:
            cfg[key] = cfg_ids
        (out / engine / "config.json").write_text(json.dumps(cfg))
    (out / "job.json").write_text(json.dumps({"datasets": {str(shards): 1.0}}))
    return out


def test_export_ids_are_compared_with_the_training_manifest(tmp_path):
    out = _drafter_dir(tmp_path, [1, 14, 26])
    layers = trained_layers(out)
    assert export_layer_problems(out / "sglang", "sglang", layers) == []
    assert export_layer_problems(out / "vllm", "vllm", layers) == []  # speculators numbering: ours + 1
    # ids that start at 1 (so no format rule objects) and still name another layer than training's
    [problem] = layer_id_problems([1, 14, 25], layers, "sglang", "config.json")
    assert problem == ("config.json: eagle_aux_hidden_state_layer_ids [1, 14, 25] differ from the layers the drafter "
                       "was trained on (sglang numbering [1, 14, 26]; shards' ids [1, 14, 26], convention output_of_layer)")
    assert layer_id_problems([1, 14, 26], layers, "vllm", "config.json")  # sglang ids in a vLLM config are off by one
    other = dict(layers, convention="entering_layer")
    assert "cannot be compared" in layer_id_problems([1, 14, 26], other, "sglang", "config.json")[0]


def test_missing_training_record_is_named(tmp_path):
    out = _drafter_dir(tmp_path, [1, 14, 26])
    (out / "job.json").unlink()
    with pytest.raises(FileNotFoundError, match="job.json is missing"):
        trained_layers(out)


def test_eval_json_is_linked_to_the_export_it_measured(tmp_path):
    """An eval.json measured on other files than the export holds now (weights replaced after the
    evaluation) is a problem; one from before fingerprints is said, not passed in silence."""
    from eagle3_assets.drafter.export import export_sglang
    from eagle3_assets.drafter.export_review import evaluation_link_problems, export_fingerprint
    from tests.unit.drafter.test_drafter_recipe_options import tiny_drafter

    out = tmp_path / "drafter"
    export_sglang(tiny_drafter(seed=1)[0], out / "sglang", dtype="float32")
    ev = {"evaluated_export": export_fingerprint(out)}
    assert ev["evaluated_export"]["export"] == "sglang" and evaluation_link_problems(ev, out) == ([], "")
    export_sglang(tiny_drafter(seed=2)[0], out / "sglang", dtype="float32")  # another drafter's weights
    [problem], _ = evaluation_link_problems(ev, out)
    assert problem == ("eval.json measured other files than the sglang export holds now (model.safetensors changed "
                       "since): re-materialize the drafter")
    problems, note = evaluation_link_problems({}, out)
    assert problems == [] and "records no fingerprint" in note
