"""The ``slurm`` launcher: a stage's :class:`~eagle3_assets.launchers.Launch` as one SLURM job, on the
``slurm`` resource's cluster with the step's ``config.slurm`` job shape over it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from eagle3_assets.launchers import Launch
from eagle3_assets.slurm import scheduler
from eagle3_assets.slurm.script import render_script


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

    def start(self, context, launch: Launch, folder: Path) -> SlurmStarted:
        """Submit ``launch`` as a job of its own (script, output and exit record in ``folder``, which
        must be on the shared filesystem) and return without following it: no Pipes session, the
        process reports through its own files."""
        already = scheduler.live_jobs_named(launch.name)
        if already:
            j = already[0]
            raise RuntimeError(f"SLURM job {j.job_id} ({j.state}) is already running {launch.name}; "
                               f"`scancel {j.job_id}`, then launch again")
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        script = folder / "job.sh"
        script.write_text(render_script(launch, self.client.resources, self.client.environment, folder,
                                        comment=f"dagster-run:{context.run.run_id}"))
        job_id = scheduler.sbatch(script)
        context.log.info(f"{launch.name}: submitted SLURM job {job_id} ({self.client.resources.nodes} node(s)): {script}")
        return SlurmStarted(job_id, folder)


@dataclass
class SlurmStarted:
    """A job submitted by :meth:`SlurmLauncher.start`, followed through ``squeue`` and its exit record."""

    job_id: str
    folder: Path

    @property
    def log(self) -> Path:
        return self.folder / f"slurm-{self.job_id}.out"

    def poll(self) -> int | None:
        entry = scheduler.squeue_job(self.job_id)
        if entry is not None and entry.live:
            return None
        record = scheduler.final_record(self.job_id, self.folder / f"exit-{self.job_id}.json")
        if record.state in scheduler.LIVE_STATES:
            return None
        if record.ok:
            return 0
        code = record.exit_code.split(":")[0]
        return int(code) if code.isdigit() and int(code) else 1

    def queued(self) -> bool:
        """Pending (or requeued and pending again): no node is running it yet."""
        entry = scheduler.squeue_job(self.job_id)
        return entry is not None and entry.state in scheduler.WAITING_STATES

    def stop(self, grace_s: float = 10.0) -> None:
        """``scancel`` (SIGTERM to its steps, SIGKILL after the cluster's KillWait), then until it left the queue."""
        scheduler.scancel(self.job_id)
        deadline = time.monotonic() + grace_s + 60.0
        while time.monotonic() < deadline:
            entry = scheduler.squeue_job(self.job_id)
            if entry is None or not entry.live:
                return
            time.sleep(0.5)
