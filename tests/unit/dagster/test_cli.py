"""The headless command line: what runs without a webserver."""

import pytest

from eagle3_assets import cli


def test_backfill_without_a_webserver_says_so(capsys):
    rc = cli.main(["backfill", "alpha", "beta", "--url", "http://127.0.0.1:9"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "no Dagster webserver at http://127.0.0.1:9" in err and "eagle3 ui" in err


def test_backfill_rejects_a_bad_dataset_name(capsys):
    assert cli.main(["backfill", "bad name"]) == 2
    assert "not usable as a partition key" in capsys.readouterr().err


def test_export_without_a_drafter(layout, capsys):
    assert cli.main(["export", "demo"]) == 2
    out = capsys.readouterr()
    assert str(layout.drafter_dir("demo") / "sglang") in out.out
    assert "materialize drafter_checkpoint[demo]" in out.err


def test_export_reports_an_invalid_sglang_export(layout, capsys):
    d = layout.drafter_dir("demo") / "sglang"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    assert cli.main(["export", "demo"]) == 2  # and no job.json: the layers it was trained on are unknown
    err = capsys.readouterr().err
    assert "sglang export: " in err and "config.json or model.safetensors is missing" in err
    assert "job.json is missing" in err


def _trained_exports(layout, ids=(1, 14, 26)):
    """Both exports of a tiny drafter trained (per its job.json and shard manifest) on ``ids``."""
    import json

    from eagle3_assets.drafter import formats
    from eagle3_assets.target.layers import convention
    from tests.unit.drafter.test_drafter_recipe_options import tiny_drafter

    out = layout.drafter_dir("demo")
    model, _, _ = tiny_drafter()
    model.config.aux_layer_ids = list(ids)
    formats.export("sglang", model, out / "sglang", dtype="float32")
    formats.export("vllm", model, out / "vllm", dtype="float32")
    shards = layout.hidden_states_dir("demo_chat")
    shards.mkdir(parents=True)
    (shards / "manifest.json").write_text(json.dumps({"layers": convention(list(ids), 30)}))
    (out / "job.json").write_text(json.dumps({"datasets": {str(shards): 1.0}}))
    (out / "result.json").write_text(json.dumps({"steps": 8, "exported_step": 5, "eal_last": 1.5,
                                                 "acceptance_estimates": [{"step": 5, "eal": 1.75, "k": 3}]}))
    from eagle3_assets.drafter.export_fingerprint import fingerprints

    (out / "eval.json").write_text(json.dumps({"exports": fingerprints(out, ("sglang", "vllm"))}))  # as evaluated
    return out


def _set_ids(export_dir, ids, vllm: bool):
    import json

    cfg = json.loads((export_dir / "config.json").read_text())
    if vllm:  # speculators: top level
        cfg["eagle_aux_hidden_state_layer_ids"] = ids
    else:
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    (export_dir / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("engine,ids,want", [("sglang", [1, 14, 25], [1, 14, 26]), ("vllm", [2, 15, 26], [2, 15, 27])])
def test_export_compares_both_exports_layers_with_training(layout, capsys, engine, ids, want):
    """Ids every format rule accepts (three, increasing, the right start) but another layer than
    training's: the command fails with exit 2 and names both lists, in that engine's numbering."""
    out = _trained_exports(layout)
    assert cli.main(["export", "demo"]) == 0
    printed = capsys.readouterr().out
    assert "name the trained layers" in printed
    assert "trained weights   step 5 of 8, the best by the acceptance estimate: EAL 1.750 at k=3 (the last " \
           "checkpoint's 1.500)" in printed
    _set_ids(out / engine, ids, engine == "vllm")
    assert cli.main(["export", "demo"]) == 2
    err = capsys.readouterr().err
    assert f"{engine} export: config.json: eagle_aux_hidden_state_layer_ids {ids} differ from the layers the drafter " \
           f"was trained on ({engine} numbering {want}" in err, err


def test_vllm_export_numbering_problem_in_vllms_terms(layout, capsys):
    out = _trained_exports(layout)
    _set_ids(out / "vllm", [3, 15, 27], vllm=True)
    assert cli.main(["export", "demo"]) == 2
    err = capsys.readouterr().err
    assert "eagle_aux_hidden_state_layer_ids [3, 15, 27] (vLLM's numbering, output-of-layer id + 1) do not start at 2" \
        in err, err


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_export_refuses_files_other_than_the_evaluated_ones(layout, capsys, engine):
    """One byte of an export's fc.weight changed after the evaluation: every format and layer rule
    still passes, and the command exits 2 naming the export; an eval.json without fingerprints, or
    none at all, exits 2 too."""
    import json

    from tests.unit.drafter.test_acceptance_check import flip_byte

    out = _trained_exports(layout)
    flip_byte(out / engine / "model.safetensors", "fc.weight")
    assert cli.main(["export", "demo"]) == 2
    err = capsys.readouterr().err
    assert (f"the {engine} export is not the one eval.json records (model.safetensors changed since): "
            "re-materialize drafter_checkpoint[demo]") in err and "exports ok" not in err
    (out / "eval.json").write_text(json.dumps({"trained": {}}))
    assert cli.main(["export", "demo"]) == 2
    assert "eval.json records no fingerprint of the vllm export" in capsys.readouterr().err
    (out / "eval.json").unlink()
    assert cli.main(["export", "demo"]) == 2
    assert "no eval.json: the exports were never evaluated" in capsys.readouterr().err


def test_export_of_an_unknown_or_invalid_recipe_is_one_line_and_status_2(layout, capsys):
    assert cli.main(["export", "no-such-recipe"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "no recipe named 'no-such-recipe'" in err
    recipes = layout.root / "recipes"
    recipes.mkdir(parents=True)
    (recipes / "bad.toml").write_text('datasets = { demo_chat = 1.0 }\ndraft_vocab_size = 512\nlearning_rate = 3\n')
    assert cli.main(["export", "bad"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: {recipes / 'bad.toml'}: field 'learning_rate': unknown field" in err


def test_materialize_needs_a_prompt_file(layout, capsys):
    assert cli.main(["materialize", "nothing"]) == 2
    assert "no prompt file" in capsys.readouterr().err


@pytest.mark.model
def test_materialize_runs_a_dataset_through_the_corpus_in_the_instance(layout, model_dir, monkeypatch, capsys):
    import dagster as dg

    from tests.conftest import small_prompts, write_jsonl

    monkeypatch.setenv("DAGSTER_HOME", str(layout.root / "dagster"))
    write_jsonl(layout.prompt_source("tiny"), small_prompts(2))
    assert cli.main(["materialize", "tiny", "--max-new-tokens", "8", "--batch-size", "2"]) == 0
    assert layout.corpus("tiny").exists()
    instance = dg.DagsterInstance.get()
    runs = instance.get_runs()
    assert len(runs) == 1 and runs[0].tags.get("dagster/partition") == "tiny"
    assert runs[0].status == dg.DagsterRunStatus.SUCCESS
    assert "tiny through merged_corpus: ok" in capsys.readouterr().out
