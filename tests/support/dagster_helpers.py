"""Running the real graph in tests: a real instance, the real model, small settings."""

import dagster as dg

from eagle3_assets.definitions import DATA_ASSETS, DATA_CHECKS, default_resources
from eagle3_assets.partitions import datasets_partitions
from eagle3_assets.resources import TargetResource


def small_run_config(max_new_tokens: int = 16, **extra) -> dict:
    return {"ops": {"raw_responses": {"config": {"max_new_tokens": max_new_tokens, "batch_size": 4, **extra}}}}


def run_dataset(instance, dataset: str, *, run_config=None, resources=None, selection=None):
    if not instance.has_dynamic_partition(datasets_partitions.name, dataset):
        instance.add_dynamic_partitions(datasets_partitions.name, [dataset])
    res = default_resources()
    res.update(resources or {})
    return dg.materialize(
        [*DATA_ASSETS, *DATA_CHECKS], partition_key=dataset, instance=instance, resources=res,
        run_config=small_run_config() if run_config is None else run_config, raise_on_error=False, selection=selection,
    )


def wrong_end_of_turn_target() -> TargetResource:
    """The original pipeline's mistake: the wrong string configured as the end of a turn."""
    return TargetResource(end_of_turn="<|endoftext|>")


def materialized(result, asset: str) -> bool:
    return bool(result.asset_materializations_for_node(asset))


def checks_by_name(result) -> dict:
    return {e.check_name: e for e in result.get_asset_check_evaluations()}


def run_hidden_states(instance, dataset: str, *, config: dict | None = None):
    """``hidden_states`` and its integrity check for a dataset whose corpus exists."""
    from eagle3_assets.hidden_states.assets import hidden_states
    from eagle3_assets.hidden_states.checks import shard_integrity

    return dg.materialize(
        [*DATA_ASSETS, hidden_states, shard_integrity], partition_key=dataset, instance=instance,
        resources=default_resources(), selection=["hidden_states"], raise_on_error=False,
        run_config={"ops": {"hidden_states": {"config": config or {}}}},
    )


def run_drafter(instance, recipe: str, *, config: dict | None = None):
    from eagle3_assets.drafter.assets import drafter_checkpoint
    from eagle3_assets.drafter.checks import drafter_acceptance
    from eagle3_assets.hidden_states.assets import hidden_states

    return dg.materialize(
        [*DATA_ASSETS, hidden_states, drafter_checkpoint, drafter_acceptance], partition_key=recipe,
        instance=instance, resources=default_resources(), selection=["drafter_checkpoint"], raise_on_error=False,
        run_config={"ops": {"drafter_checkpoint": {"config": config or {"threads": 1}}}},
    )
