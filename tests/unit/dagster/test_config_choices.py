"""The Dagster configs take a registry's names as typed choices: a wrong name is refused by the
config schema (before any run starts), and the refusal names every valid one."""

from __future__ import annotations

import dagster as dg
import pytest


def _job():
    from eagle3_assets.definitions import defs

    return defs.resolve_implicit_global_asset_job_def()


@pytest.mark.parametrize("asset,field,names", [
    ("raw_responses", "backend", "eagle3_assets.generation.assets:BACKENDS"),
    ("drafter_checkpoint", "launcher", "eagle3_assets.launchers:LAUNCHERS"),
    ("hidden_states", "launcher", "eagle3_assets.launchers:LAUNCHERS"),
    ("hidden_states", "backend", "eagle3_assets.hidden_states.assets:EXTRACTION_BACKENDS"),
])
def test_a_wrong_name_is_refused_by_the_config_schema_naming_the_valid_ones(asset, field, names):
    import importlib

    module, _, attr = names.partition(":")
    valid = getattr(importlib.import_module(module), attr)
    job = _job()
    with pytest.raises(dg.DagsterInvalidConfigError) as err:
        dg.validate_run_config(job, {"ops": {asset: {"config": {field: "nosuchname"}}}})
    message = str(err.value)
    assert f"{asset}:config:{field}" in message and "nosuchname" in message
    for name in valid:
        assert repr(name) in message, (name, message)
    for name in valid:  # every registered name passes the same schema
        assert dg.validate_run_config(job, {"ops": {asset: {"config": {field: name}}}})


def test_the_python_config_classes_refuse_a_wrong_name_too():
    from pydantic import ValidationError

    from eagle3_assets.drafter.assets import DrafterTrainingConfig
    from eagle3_assets.generation.assets import GenerationConfig
    from eagle3_assets.hidden_states.assets import HiddenStatesConfig

    with pytest.raises(ValidationError, match="'local'"):
        GenerationConfig(backend="nosuchname")
    with pytest.raises(ValidationError, match="'slurm'"):
        DrafterTrainingConfig(launcher="nosuchname")
    with pytest.raises(ValidationError, match="'slurm'"):
        HiddenStatesConfig(launcher="nosuchname")
    with pytest.raises(ValidationError, match="'sglang'"):
        HiddenStatesConfig(backend="nosuchname")
    assert GenerationConfig().backend == "local" and DrafterTrainingConfig().launcher == "local"
    assert (HiddenStatesConfig().backend, HiddenStatesConfig().launcher) == ("local", "local")
