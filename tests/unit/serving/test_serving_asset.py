"""``serving_benchmark`` materialized by Dagster with a registered serve engine that runs no server
(``tests/support/fake_serve.py``): the metadata, the best setting next to the exports, reuse of an
unchanged export, and the checks failing on a mismatch (naming prompt and setting) and on a
benchmark prompt found in the training data."""

from __future__ import annotations

import json

import dagster as dg
import pytest

from tests.support import fake_serve

CONFIG = {"chains": [1, 2], "concurrency": [1, 2], "max_new_tokens": 6, "per_category": 1, "heldout_per_dataset": 0}


@pytest.fixture
def fake_engine(monkeypatch, layout, model_dir):
    import eagle3_assets.definitions  # noqa: F401  (the stages' config choices read the registry on import)
    from eagle3_assets import engines

    roles = {k: v for k, v in engines.ROLES.items() if k[0] != "serve"}  # the only serve engine: the fake one
    monkeypatch.setattr(engines, "ROLES", {**roles, ("serve", "fake"): "tests.support.fake_serve:SERVE"})
    monkeypatch.setattr(fake_serve, "SERVE", fake_serve.FakeServe())
    export = layout.drafter_dir("demo") / "fake"
    export.mkdir(parents=True)
    (export / "config.json").write_text("{}")
    return fake_serve.SERVE


def _materialize(instance):
    from eagle3_assets.definitions import default_resources
    from eagle3_assets.serving.assets import serving_benchmark
    from eagle3_assets.serving.checks import SERVING_CHECKS

    return dg.materialize([serving_benchmark, *SERVING_CHECKS], partition_key="demo", instance=instance,
                          resources=default_resources(), run_config={"ops": {"serving_benchmark": {"config": CONFIG}}},
                          raise_on_error=False)


def _checks(result) -> dict:
    return {c.check_name: c for c in result.get_asset_check_evaluations()}


def test_materialize_reuse_and_a_mismatch_that_fails_the_check(fake_engine, layout, capsys):
    with dg.instance_for_test() as instance:
        result = _materialize(instance)
        assert result.success
        meta = result.asset_materializations_for_node("serving_benchmark")[0].metadata
        assert meta["cells_measured"].value == 3 * 2 * 8 and meta["cells_reused"].value == 0
        assert "chain 2" in meta["table"].value and "data:image/png;base64" in meta["speedup_plot"].value
        checks = _checks(result)
        assert all(c.passed for c in checks.values()), {k: c.description for k, c in checks.items()}
        best = json.loads((layout.drafter_dir("demo") / "serving.json").read_text())
        assert set(best["fake"]) == {"1", "2"} and best["fake"]["1"]["serve_command"].startswith("fake-serve")
        assert best["fake"]["1"]["provenance"]["engine_version"] == "fake 1.0"
        from eagle3_assets.cli import _print_best

        _print_best(layout.drafter_dir("demo"))
        printed = capsys.readouterr().out
        assert "fake at concurrency 1: chain" in printed and best["fake"]["1"]["serve_command"] in printed

        again = _materialize(instance)
        meta = again.asset_materializations_for_node("serving_benchmark")[0].metadata
        assert meta["cells_measured"].value == 0 and meta["cells_reused"].value == 48
        assert fake_engine.started == [0, 1, 2]  # nothing served the second time

        (layout.drafter_dir("demo") / "fake" / "config.json").write_text('{"retrained": true}')
        agentic = next(p for p in _bundled_first() if p.category == "agentic")
        ids = agentic.render(_tokenizer(layout))
        fake_engine.corrupt = {(2, len(ids))}
        bad = _materialize(instance)
        meta = bad.asset_materializations_for_node("serving_benchmark")[0].metadata
        assert meta["cells_measured"].value == 48  # a changed export runs again
        check = _checks(bad)["serving_outputs_equal_baseline"]
        assert not check.passed
        assert f"prompt {agentic.prompt_id} (agentic) differs from the baseline under fake chain 2" in check.description
        best = json.loads((layout.drafter_dir("demo") / "serving.json").read_text())
        assert {b["setting"] for b in best["fake"].values()} == {"chain 1"}


def _tokenizer(layout):
    from eagle3_assets.target.embedded import ensure_default_model
    from eagle3_assets.target.spec import TargetSpec

    return TargetSpec(ensure_default_model(layout.models_dir)).load_tokenizer()


def _bundled_first():
    from eagle3_assets.serving.bench_prompts import bundled_prompts, take_per_category

    return take_per_category(bundled_prompts(), 1)


def test_a_benchmark_prompt_in_the_training_corpus_fails_its_check(fake_engine, layout):
    import polars as pl

    tok = _tokenizer(layout)
    math = next(p for p in _bundled_first() if p.category == "math")
    ids = math.render(tok)
    layout.corpus("math").parent.mkdir(parents=True, exist_ok=True)
    pl.DataFrame({"input_ids": [ids + [1, 2]], "prompt_len": [len(ids)], "split": ["train"]}).write_parquet(
        layout.corpus("math"))
    with dg.instance_for_test() as instance:
        check = _checks(_materialize(instance))["serving_prompts_not_trained_on"]
    assert not check.passed and f"benchmark prompt {math.prompt_id} (math" in check.description
    assert "training data of math" in check.description
