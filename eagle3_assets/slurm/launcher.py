"""The ``slurm`` launcher: a stage's :class:`~eagle3_assets.launchers.Launch` as one SLURM job, on the
``slurm`` resource's cluster with the step's ``config.slurm`` job shape over it."""

from __future__ import annotations

from eagle3_assets.launchers import Launch
from eagle3_assets.slurm import scheduler


class SlurmLauncher:
    """Submits through :class:`~eagle3_assets.slurm.pipes_client.PipesSlurmClient` and follows the job."""

    here = False

    def __init__(self, client):
        self.client = client
        self.tasks, self.nodes = client.resources.tasks, client.resources.nodes

    @classmethod
    def open(cls, context, config, layout) -> SlurmLauncher:
        return cls(context.resources.slurm.client(layout, config.slurm))

    def running(self, name: str) -> bool:
        return bool(scheduler.live_jobs_named(name))

    def run(self, context, launch: Launch):
        context.log.info(f"{launch.name}: {self.tasks} SLURM task(s) on {self.nodes} node(s)")
        return self.client.run(context=context, launch=launch)
