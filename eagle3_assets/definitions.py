"""The code location: assembles each stage's assets and checks, the sensors, jobs and default resources."""

import os

import dagster as dg

from eagle3_assets.corpus.assets import inventory, merged_corpus
from eagle3_assets.corpus.checks import CORPUS_CHECKS
from eagle3_assets.drafter.assets import drafter_checkpoint
from eagle3_assets.drafter.checks import drafter_acceptance
from eagle3_assets.generation.assets import raw_responses
from eagle3_assets.hidden_states.assets import hidden_states
from eagle3_assets.hidden_states.checks import shard_integrity
from eagle3_assets.prompts.assets import prompts
from eagle3_assets.resources import (
    DatasetSettings,
    OpenRouterResource,
    SGLangResource,
    SlurmResource,
    StorageResource,
    TargetResource,
    VLLMResource,
)
from eagle3_assets.runs import executor as frees_dead_slots_executor
from eagle3_assets.sensors import prompt_files_sensor, run_failure_alerts
from eagle3_assets.serving.assets import serving_benchmark
from eagle3_assets.serving.checks import SERVING_CHECKS
from eagle3_assets.tokens.assets import token_ids
from eagle3_assets.tokens.checks import TOKEN_CHECKS

# Downstream CPU stages follow their inputs by themselves once the daemon runs: eager, but only
# when every blocking check on their dependencies passed (a failed check stops the cascade).
AUTOMATION_CONDITION = dg.AutomationCondition.eager() & dg.AutomationCondition.all_deps_blocking_checks_passed()
AUTOMATED = ("token_ids", "inventory", "merged_corpus")


def with_automation(asset: dg.AssetsDefinition) -> dg.AssetsDefinition:
    if asset.key.to_user_string() not in AUTOMATED:
        return asset
    return asset.with_attributes(automation_condition=AUTOMATION_CONDITION)


prompts, raw_responses, token_ids, inventory, merged_corpus = (
    with_automation(a) for a in (prompts, raw_responses, token_ids, inventory, merged_corpus)
)
DATA_ASSETS = [prompts, raw_responses, token_ids, inventory, merged_corpus]

dataset_pipeline = dg.define_asset_job(
    "dataset_pipeline",
    selection=dg.AssetSelection.assets(*DATA_ASSETS),
    description="One dataset from its prompt file to its merged corpus, checks included.",
)


def default_resources() -> dict:
    return {
        "storage": StorageResource(),
        "target": TargetResource(model=os.environ.get("EAGLE3_TARGET", "")),  # e.g. kimi-mini
        "dataset_settings": DatasetSettings(),
        "sglang": SGLangResource(),
        "vllm": VLLMResource(),
        "slurm": SlurmResource(),  # used only by GPU stages launched with `launcher: slurm`
        # EnvVar keeps the key out of the UI and run config; bound only when set, so runs that
        # never call OpenRouter do not fail for want of a key.
        "openrouter": OpenRouterResource(
            api_key=dg.EnvVar("OPENROUTER_API_KEY") if os.environ.get("OPENROUTER_API_KEY") else ""
        ),
    }


DATA_CHECKS = [*TOKEN_CHECKS, *CORPUS_CHECKS]

# GPU stages never start by themselves: they run when launched or backfilled.
GPU_ASSETS = [hidden_states, drafter_checkpoint, serving_benchmark]
GPU_CHECKS = [shard_integrity, drafter_acceptance, *SERVING_CHECKS]
ALL_ASSETS = [*DATA_ASSETS, *GPU_ASSETS]
ALL_CHECKS = [*DATA_CHECKS, *GPU_CHECKS]

defs = dg.Definitions(
    assets=ALL_ASSETS,
    asset_checks=ALL_CHECKS,
    jobs=[dataset_pipeline],
    sensors=[prompt_files_sensor, run_failure_alerts],
    resources=default_resources(),
    executor=frees_dead_slots_executor,  # a step blocked by a pool frees slots of runs whose process is gone
)
