"""drafter_acceptance's decisions without a model: the acceptance bar (floor, margin over the
untrained twin, the recipe's figures in eval.json), the export's aux layers against training, and
the exports' files against the fingerprints eval.json (and, before evaluation, result.json) records."""

import json
from pathlib import Path

import pytest
import torch

from eagle3_assets.drafter import formats
from eagle3_assets.drafter.checks import acceptance_problems
from eagle3_assets.drafter.trained_layers import layer_id_problems, trained_layers
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
    assert formats.layer_problems("sglang", out / "sglang", layers) == []
    assert formats.layer_problems("vllm", out / "vllm", layers) == []  # speculators numbering: ours + 1
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


def flip_byte(safetensors_path: Path, tensor: str) -> None:
    """One byte in the middle of ``tensor``'s data changed, the file's size and header kept."""
    raw = bytearray(safetensors_path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    a, b = json.loads(raw[8:8 + n])[tensor]["data_offsets"]
    raw[8 + n + (a + b) // 2] ^= 0x01
    safetensors_path.write_bytes(bytes(raw))


def swap_d2t(safetensors_path: Path, i: int = 3, j: int = 7) -> None:
    """Two entries of the export's d2t map exchanged, every other tensor as it was."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(safetensors_path), framework="pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    d2t = tensors["d2t"].clone()
    d2t[[i, j]] = d2t[[j, i]]
    assert not torch.equal(d2t, tensors["d2t"])
    save_file({**tensors, "d2t": d2t}, str(safetensors_path), metadata=meta)


def both_exports(out: Path, seed: int = 1) -> None:
    from eagle3_assets.drafter import formats
    from tests.unit.drafter.test_drafter_recipe_options import tiny_drafter

    model = tiny_drafter(seed=seed)[0]
    formats.export("sglang", model, out / "sglang", dtype="float32")
    formats.export("vllm", model, out / "vllm", dtype="float32")


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("change", ["fc byte", "d2t swap"])
def test_eval_json_is_linked_to_every_export(tmp_path, engine, change):
    """eval.json fingerprints both exports; a byte of fc.weight or two d2t entries changed in either
    afterwards fail the link (both still pass their format checks), naming the export and file."""
    from eagle3_assets.drafter.export_fingerprint import fingerprints
    from eagle3_assets.drafter.export_review import evaluation_link_problems

    out = tmp_path / "drafter"
    both_exports(out)
    ev = {"exports": fingerprints(out, ("sglang", "vllm"))}
    assert set(ev["exports"]) == {"sglang", "vllm"} and evaluation_link_problems(ev, out, ("sglang", "vllm"), "demo") == []
    weights = out / engine / "model.safetensors"
    flip_byte(weights, "fc.weight") if change == "fc byte" else swap_d2t(weights)
    assert formats.file_problems(engine, out / engine) == []  # the serving contract cannot see it
    assert evaluation_link_problems(ev, out, ("sglang", "vllm"), "demo") == [
        f"the {engine} export is not the one eval.json records (model.safetensors changed since): "
        "re-materialize drafter_checkpoint[demo]"]


def test_an_eval_json_without_fingerprints_fails_naming_what_to_rematerialize(tmp_path):
    from eagle3_assets.drafter.export_review import evaluation_link_problems

    out = tmp_path / "drafter"
    both_exports(out)
    problems = evaluation_link_problems({"evaluated_export": {"export": "sglang"}}, out, ("sglang", "vllm"), "demo")
    assert problems == [f"eval.json records no fingerprint of the {e} export, so nothing links it to the files there: "
                        "re-materialize drafter_checkpoint[demo]" for e in ("sglang", "vllm")]


def test_the_evaluation_checks_the_exports_against_what_the_trainer_wrote(tmp_path):
    """An export changed between training and evaluation is refused before it is loaded."""
    from types import SimpleNamespace

    from eagle3_assets.drafter.evaluate import ExportDigestError, checked_exports
    from eagle3_assets.drafter.export_fingerprint import fingerprints

    out = tmp_path / "drafter"
    both_exports(out)
    (out / "result.json").write_text(json.dumps({"exports": fingerprints(out, ("sglang", "vllm"))}))
    recipe = SimpleNamespace(name="demo", shape=SimpleNamespace(engines=("sglang", "vllm")))
    assert set(checked_exports(out, recipe)) == {"sglang", "vllm"}
    flip_byte(out / "vllm" / "model.safetensors", "fc.weight")
    with pytest.raises(ExportDigestError, match=r"the vllm export is not the one result.json \(the trainer, as it wrote "
                                                 r"them\) records \(model.safetensors changed since\)"):
        checked_exports(out, recipe)


def test_the_held_out_prompts_are_read_from_the_corpus_merged_corpus_wrote(layout):
    """Evaluation cuts each held-out prompt at its prompt_len: an edited one is refused, not used."""
    import polars as pl

    from eagle3_assets.drafter.evaluate import eval_prompts
    from eagle3_assets.tokens.digest import write_digested_parquet

    frame = pl.DataFrame({"sample_id": ["a", "b"], "input_ids": [[1, 2, 3, 4], [5, 6, 7]], "prompt_len": [2, 1],
                          "split": ["eval", "train"]}, schema_overrides={"input_ids": pl.List(pl.Int32)})
    write_digested_parquet(frame, layout.corpus("facts"))
    assert eval_prompts(layout, {"facts": 1.0}, 10) == [[1, 2]]
    frame.with_columns(pl.Series("prompt_len", [3, 1])).write_parquet(layout.corpus("facts"))
    with pytest.raises(ValueError, match=r"carries no table digest .* re-materialize merged_corpus\[facts\]"):
        eval_prompts(layout, {"facts": 1.0}, 10)
