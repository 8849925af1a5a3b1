"""Watches ``prompts/*.jsonl``: a new file becomes a dataset partition and its prompts are read."""


import dagster as dg

from eagle3_assets.assets.prompts import prompts
from eagle3_assets.partitions import datasets_partitions
from resources import StorageResource


@dg.sensor(
    target=[prompts],
    minimum_interval_seconds=30,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Adds a dataset partition for each new prompts/<dataset>.jsonl and materializes its prompts.",
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
        run_requests=[dg.RunRequest(partition_key=name, run_key=f"prompts:{name}") for name in new],
    )
