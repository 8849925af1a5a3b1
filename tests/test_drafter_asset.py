"""The whole graph on three tiny datasets, up to a trained drafter and its acceptance check."""

import json

import dagster as dg
import pytest

from eagle3_assets.drafter.export import check_sglang_export
from eagle3_assets.drafter.recipes import load_recipe
from resources import DatasetSettings
from tests.conftest import small_prompts, write_jsonl
from tests.dagster_helpers import checks_by_name, run_dataset, run_drafter, run_hidden_states

pytestmark = pytest.mark.model


def test_demo_recipe_trains_through_pipes_and_is_measured(layout, model_dir):
    recipe = load_recipe("demo")
    settings = {"dataset_settings": DatasetSettings(eval_fraction=0.5)}
    with dg.instance_for_test() as instance:
        for name in recipe.datasets:
            write_jsonl(layout.prompt_source(name), small_prompts(4, prefix=f"{name}-"))
            assert run_dataset(instance, name, resources=settings).success
            assert run_hidden_states(instance, name).success
        result = run_drafter(instance, "demo")
        assert result.success, [e.message for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
        meta = result.asset_materializations_for_node("drafter_checkpoint")[0].metadata
        out = layout.drafter_dir("demo")
        assert check_sglang_export(out / "sglang") == []
        assert (out / "vllm" / "config.json").exists()
        ev = json.loads((out / "eval.json").read_text())
        assert ev["trained"]["matches_greedy"] and ev["untrained"]["matches_greedy"]
        assert meta["acceptance_length"].value == ev["trained"]["acceptance_length"] >= 1.0
        assert meta["untrained_acceptance_length"].value == ev["untrained"]["acceptance_length"]
        check = checks_by_name(result)["drafter_acceptance"]
        assert check.passed == (ev["trained"]["acceptance_length"] >= recipe.evaluation.acceptance_floor)
