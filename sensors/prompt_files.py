"""Watches ``prompts/``: a new ``<dataset>.jsonl``, ``.jsonl.gz`` or ``.parquet`` becomes a dataset
partition; its prompts are read (with ``<dataset>.read.json`` when present) and its responses
generated (local backend, the asset's default config). The CPU stages after them follow through
their automation conditions. Copy a large file in under another name and rename it, or use
``eagle3 add-dataset``, so that the sensor never sees half a file."""


import dagster as dg

from eagle3_assets.generation.assets import raw_responses
from eagle3_assets.partitions import datasets_partitions
from eagle3_assets.prompts.assets import prompts
from eagle3_assets.resources import StorageResource

# Local generation, the asset's default backend; other backends are launched with their config.
REQUESTED = [prompts.key, raw_responses.key]


@dg.sensor(
    target=[prompts, raw_responses],
    minimum_interval_seconds=30,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Adds a dataset partition for each new prompts/<dataset>.jsonl, .jsonl.gz or .parquet and "
    "materializes its prompts and raw_responses (local backend).",
)
def prompt_files_sensor(context: dg.SensorEvaluationContext, storage: StorageResource):
    on_disk = storage.layout.datasets_on_disk()
    known = set(context.instance.get_dynamic_partitions(datasets_partitions.name))
    new = [name for name in on_disk if name not in known]
    if not new:
        return dg.SkipReason(f"no new prompt files among {len(on_disk)} in {storage.layout.prompts_dir}")
    context.log.info(f"new datasets: {', '.join(new)}")
    return dg.SensorResult(
        dynamic_partitions_requests=[datasets_partitions.build_add_request(new)],
        run_requests=[
            dg.RunRequest(partition_key=name, run_key=f"prompts+raw_responses:{name}", asset_selection=REQUESTED)
            for name in new
        ],
    )
