"""``PipesSlurmClient``: one stage's entry point as one SLURM job, reporting through Dagster Pipes.

The step writes the Pipes context, the batch script and (from the job) the Pipes messages and the
job's output into one folder on the shared filesystem, submits with ``sbatch`` and follows the job
until it ends: pending (with the reason ``squeue`` gives) and state changes go to the step's log,
the job's output to the step's stderr, Pipes messages (progress, the materialization) to Dagster.
If the step is interrupted (the run terminated in the UI) or fails while the job lives, the job is
cancelled with ``scancel`` before the step ends, so no job outlives its step.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import dagster as dg

from eagle3_assets.launchers import Launch
from eagle3_assets.slurm import scheduler
from eagle3_assets.slurm.script import JobEnvironment, JobResources, render_script
from eagle3_assets.slurm.shared_files import FileTail, SharedFileMessageReader

PENDING_LOG_EVERY_S = 60.0
SCHEDULER_OUTAGE_S = 300.0  # squeue failing this long (slurmctld down) fails the step
LOG_TAIL_LINES = 60  # a launched job's whole traceback: its frames from run_job_main down, and srun's lines after


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name) or "_"


class SlurmJobFailed(dg.Failure):
    """The job ended in a state other than COMPLETED; the message has the state and the log tail."""


class PipesSlurmClient(dg.PipesClient):
    """Runs a :class:`~eagle3_assets.launchers.Launch` as a SLURM job inside a Pipes session."""

    def __init__(self, resources: JobResources, environment: JobEnvironment, job_root: Path | str, *,
                 poll_interval_s: float = 5.0, cancel_timeout_s: float = 120.0, drain_timeout_s: float = 60.0,
                 output=None):
        self.resources, self.environment = resources, environment
        self.job_root = Path(job_root)
        self.poll_interval_s, self.cancel_timeout_s, self.drain_timeout_s = poll_interval_s, cancel_timeout_s, drain_timeout_s
        self.output = output  # where the job's output lines go (default: this step's stderr)

    def job_dir(self, context) -> Path:
        step = context.asset_key.to_user_string() if context.has_assets_def else context.op.name
        partition = context.partition_key if context.has_partition_key else "all"
        return self.job_root / _safe(step) / _safe(partition) / f"{time.strftime('%Y%m%d-%H%M%S')}-{context.run.run_id[:8]}"

    def run(self, *, context, launch: Launch, extras=None) -> dg.PipesClientCompletedInvocation:  # noqa: D417
        """Submit, follow to the end, and return the invocation (its ``metadata`` has the job's figures)."""
        already = scheduler.live_jobs_named(launch.name)
        if already:
            j = already[0]
            raise dg.Failure(f"SLURM job {j.job_id} ({j.state}, {j.comment or 'no comment'}) is already working on "
                             f"{launch.name}; wait for it to end or `scancel {j.job_id}`, then launch again "
                             "(the new job resumes from what that one wrote)")
        job_dir = self.job_dir(context)
        job_dir.mkdir(parents=True, exist_ok=True)
        injector = dg.PipesFileContextInjector(str(job_dir / "pipes-context.json"))
        reader = SharedFileMessageReader(str(job_dir / "pipes-messages.jsonl"))
        with dg.open_pipes_session(context=context, context_injector=injector, message_reader=reader,
                                   extras=extras) as session:
            launch = replace(launch, exports={**launch.exports, **session.get_bootstrap_env_vars()})
            script = job_dir / "job.sh"
            script.write_text(render_script(launch, self.resources, self.environment, job_dir,
                                            comment=f"dagster-run:{context.run.run_id}"))
            job_id = scheduler.sbatch(script)
            log = FileTail(job_dir / f"slurm-{job_id}.out")
            context.log.info(f"submitted SLURM job {job_id} ({launch.name}, {self.resources.tasks} task(s) on "
                             f"{self.resources.nodes} node(s)): {script}")
            record = None
            try:
                record = self._follow(context, job_id, log, job_dir)
            finally:
                if record is None:  # interrupted (run terminated) or an error here: the job must not outlive us
                    self._cancel(context, job_id)
            if record.ok:
                self._drain(session, Path(reader._path))
        metadata = {
            "slurm_job_id": job_id, "slurm_state": record.state, "slurm_nodes": record.nodes,
            "slurm_tasks": self.resources.tasks, "slurm_elapsed_s": record.elapsed_s,
            "slurm_queue_wait_s": record.queue_wait_s, "slurm_exit_code": record.exit_code,
            "slurm_partition": self.resources.partition or "(default)",
            "slurm_script": dg.MetadataValue.path(str(script)),
            "slurm_log": dg.MetadataValue.path(str(log.path)),
        }
        if not record.ok:
            tail = log.tail(LOG_TAIL_LINES)
            raise SlurmJobFailed(
                f"{record.describe()}. Launch again to resume from what it wrote. Last lines of {log.path}:\n{tail}",
                metadata={**metadata, "log_tail": dg.MetadataValue.md(f"```\n{tail}\n```")})
        return dg.PipesClientCompletedInvocation(session, metadata=metadata)

    # -- following the job ------------------------------------------------------------------
    def _forward(self, log: FileTail) -> None:
        out = self.output or sys.stderr
        for line in log.read():
            out.write(line + "\n")
        out.flush()

    def _follow(self, context, job_id: str, log: FileTail, job_dir: Path) -> scheduler.FinalRecord:
        said, said_at, failing_since = None, 0.0, None
        while True:
            self._forward(log)
            try:
                entry = scheduler.squeue_job(job_id)
                failing_since = None
            except scheduler.SlurmError as exc:
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > SCHEDULER_OUTAGE_S:
                    raise
                context.log.warning(f"squeue failed ({exc}); retrying")
                time.sleep(self.poll_interval_s)
                continue
            if entry is None or not entry.live:
                record = scheduler.final_record(job_id, job_dir / f"exit-{job_id}.json")
                if record.state in scheduler.LIVE_STATES:  # squeue lagged behind slurmctld: keep following
                    time.sleep(self.poll_interval_s)
                    continue
                self._forward(log)
                (context.log.info if record.ok else context.log.error)(
                    f"{record.describe()} after {record.elapsed_s or 0:.0f} s")
                return record
            now = time.monotonic()
            news = (entry.state, entry.reason, entry.nodes)
            if news != said or (entry.state == "PENDING" and now - said_at > PENDING_LOG_EVERY_S):
                context.log.info(self._describe(entry))
                said, said_at = news, now
            time.sleep(self.poll_interval_s)

    @staticmethod
    def _describe(entry: scheduler.QueueEntry) -> str:
        if entry.state == "PENDING":
            start = f", expected start {entry.start}" if entry.start not in ("", "N/A") else ""
            reason = f" ({entry.reason})" if entry.reason not in ("", "None") else ""
            return f"SLURM job {entry.job_id} is pending{reason}{start}"
        if entry.state == "RUNNING":
            return f"SLURM job {entry.job_id} is running on {entry.nodes} (elapsed {entry.elapsed})"
        return f"SLURM job {entry.job_id} is {entry.state} ({entry.reason})"

    def _cancel(self, context, job_id: str) -> None:
        try:
            scheduler.scancel(job_id)
        except scheduler.SlurmError as exc:
            context.log.error(f"could not cancel SLURM job {job_id}: {exc}; cancel it by hand (scancel {job_id})")
            return
        deadline = time.monotonic() + self.cancel_timeout_s
        entry = None
        while time.monotonic() < deadline:
            try:
                entry = scheduler.squeue_job(job_id)
            except scheduler.SlurmError:
                entry = None
            if entry is None or not entry.live:
                break
            time.sleep(1.0)
        state = entry.state if entry else "gone from the queue"
        context.log.warning(f"cancelled SLURM job {job_id} with scancel ({state})")

    def _drain(self, session, messages: Path) -> None:
        """Until the job's closing Pipes message has been read (the shared filesystem may lag)."""
        handler = session.message_handler
        wrote = handler.received_opened_message or (messages.exists() and messages.stat().st_size > 0)
        deadline = time.monotonic() + (self.drain_timeout_s if wrote else 2.0)
        while not handler.received_closed_message and time.monotonic() < deadline:
            time.sleep(0.2)
