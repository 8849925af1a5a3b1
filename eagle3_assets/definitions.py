"""The code location: assets, checks, sensors, jobs and the default resources."""


import dagster as dg

from eagle3_assets.assets.corpus import merged_corpus
from eagle3_assets.assets.inventory import inventory
from eagle3_assets.assets.prompts import prompts
from eagle3_assets.assets.responses import raw_responses
from eagle3_assets.assets.tokens import token_ids
from eagle3_assets.checks import ALL_CHECKS
from resources import DatasetSettings, EmbeddedModelResource, StorageResource, TokenizerResource
from sensors import prompt_files_sensor

DATA_ASSETS = [prompts, raw_responses, token_ids, inventory, merged_corpus]

dataset_pipeline = dg.define_asset_job(
    "dataset_pipeline",
    selection=dg.AssetSelection.assets(*DATA_ASSETS),
    description="One dataset from its prompt file to its merged corpus, checks included.",
)


def default_resources() -> dict:
    model = EmbeddedModelResource()
    return {
        "storage": StorageResource(),
        "embedded_model": model,
        "tokenizer": TokenizerResource(model=model),
        "dataset_settings": DatasetSettings(),
    }


defs = dg.Definitions(
    assets=DATA_ASSETS,
    asset_checks=ALL_CHECKS,
    jobs=[dataset_pipeline],
    sensors=[prompt_files_sensor],
    resources=default_resources(),
)
