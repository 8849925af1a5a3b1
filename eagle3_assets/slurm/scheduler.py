"""SLURM's own commands (``sbatch``, ``squeue``, ``scontrol``, ``scancel``, ``sacct``), parsed.

Accounting (``sacct``) is optional: clusters without ``slurmdbd`` still answer ``squeue`` and
``scontrol`` for a job until ``MinJobAge`` after it ends; the batch script also writes its own
exit record beside its log, the last word when the scheduler has forgotten the job.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

# States of a job that is still the scheduler's (it may start, run, be requeued, or end).
LIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_FED",
               "REQUEUE_HOLD", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"}
# Live states in which no node runs the job yet (it waits in the queue).
WAITING_STATES = {"PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESV_DEL_HOLD"}
SUCCESS = "COMPLETED"
# What each way of ending means for the user (every state not live and not COMPLETED fails the step).
ENDINGS = {
    "CANCELLED": "cancelled (scancel, an administrator, or the Dagster run was terminated)",
    "FAILED": "failed (a task exited non-zero)",
    "TIMEOUT": "reached its time limit",
    "PREEMPTED": "was preempted",
    "NODE_FAIL": "lost a node",
    "BOOT_FAIL": "could not boot its node",
    "DEADLINE": "missed its deadline",
    "OUT_OF_MEMORY": "ran out of memory",
}
COMMANDS = ("sbatch", "squeue", "scontrol", "scancel")
SQUEUE_FORMAT = "%i|%T|%r|%N|%M|%S|%V|%j|%k"


class SlurmError(RuntimeError):
    """A SLURM command failed (the message carries its output)."""


def missing_commands() -> list[str]:
    return [c for c in COMMANDS if shutil.which(c) is None]


def _run(args: list[str], *, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise SlurmError(f"{args[0]} is not installed here (SLURM's client commands must be on PATH)") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(args[:2])} did not answer within {timeout:.0f} s (is slurmctld up?)") from None
    if check and res.returncode != 0:
        raise SlurmError(f"{' '.join(args)} exited {res.returncode}: {(res.stderr or res.stdout).strip()}")
    return res


def sbatch(script: Path) -> str:
    """Submit ``script``; its job id."""
    out = _run(["sbatch", "--parsable", str(script)]).stdout.strip()
    job_id = out.split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch answered {out!r}, not a job id")
    return job_id


def scancel(job_id: str) -> None:
    _run(["scancel", str(job_id)], check=False)


@dataclass
class QueueEntry:
    """One line of ``squeue``: what the scheduler says of a job now."""

    job_id: str
    state: str
    reason: str
    nodes: str
    elapsed: str  # as squeue prints it: [days-]hours:minutes:seconds
    start: str  # actual start, or the expected one while pending ("N/A" when unknown)
    submitted: str
    name: str
    comment: str

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES


def _entries(text: str) -> list[QueueEntry]:
    rows = []
    for line in text.splitlines():
        parts = line.split("|", 8)
        if len(parts) == 9:
            rows.append(QueueEntry(*[p.strip() for p in parts]))
    return rows


def squeue_job(job_id: str) -> QueueEntry | None:
    """The job's current entry (any state while the scheduler keeps it), or None once forgotten."""
    res = _run(["squeue", "-h", "-t", "all", "-j", str(job_id), "-o", SQUEUE_FORMAT], check=False)
    if res.returncode != 0:
        if "Invalid job id" in res.stderr or not res.stderr.strip():
            return None
        raise SlurmError(f"squeue -j {job_id}: {res.stderr.strip()}")
    rows = [r for r in _entries(res.stdout) if r.job_id == str(job_id)]
    return rows[0] if rows else None


def live_jobs_named(name: str) -> list[QueueEntry]:
    """This user's queued or running jobs of that name (a launch refuses to start a second one)."""
    import getpass

    res = _run(["squeue", "-h", "-u", getpass.getuser(), "-n", name, "-o", SQUEUE_FORMAT])
    return [r for r in _entries(res.stdout) if r.live]


_PAIR = re.compile(r"(\S+?)=(.*?)(?=\s+\S+?=|\s*$)")


def scontrol_job(job_id: str) -> dict[str, str] | None:
    """``scontrol show job -o``'s fields for the job, or None once the scheduler has forgotten it."""
    res = _run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
    if res.returncode != 0 or not res.stdout.strip():
        return None
    return dict(_PAIR.findall(res.stdout.strip()))


def sacct_job(job_id: str) -> dict[str, str] | None:
    """The accounting record, where ``slurmdbd`` keeps one (None without accounting)."""
    if shutil.which("sacct") is None:
        return None
    res = _run(["sacct", "-n", "-P", "-X", "-j", str(job_id), "-o", "JobID,State,ExitCode,Elapsed,NodeList,Start,End"],
               check=False)
    for line in res.stdout.splitlines():
        parts = line.split("|")
        if res.returncode == 0 and len(parts) == 7 and parts[0] == str(job_id):
            keys = ("JobId", "JobState", "ExitCode", "RunTime", "NodeList", "StartTime", "EndTime")
            return dict(zip(keys, parts)) | {"JobState": parts[1].split()[0]}
    return None


def exit_record(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def duration_s(text: str) -> float | None:
    """Seconds in a SLURM duration (``[days-]hh:mm:ss``, ``mm:ss``); None when not a duration."""
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)(?:\.\d+)?", (text or "").strip())
    if not m:
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def timestamp(text: str) -> datetime | None:
    try:
        return datetime.fromisoformat(text)
    except (TypeError, ValueError):
        return None


@dataclass
class FinalRecord:
    """How a job ended, from the best source that still knows it."""

    job_id: str
    state: str  # a SLURM state, or "UNKNOWN"
    exit_code: str  # "code:signal", as SLURM writes it
    nodes: str
    elapsed_s: float | None
    queue_wait_s: float | None
    reason: str
    source: str  # "scontrol", "sacct", "exit record" or "none"

    @property
    def ok(self) -> bool:
        return self.state == SUCCESS

    def describe(self) -> str:
        what = ENDINGS.get(self.state, "ended")
        return (f"SLURM job {self.job_id} {what}: state {self.state}, exit code {self.exit_code}"
                + (f", reason {self.reason}" if self.reason and self.reason != "None" else "")
                + (f", on {self.nodes}" if self.nodes else ""))


def final_record(job_id: str, exit_file: Path | None = None) -> FinalRecord:
    """The job's ending: ``scontrol`` while it keeps the job, else ``sacct``, else the exit record."""
    fields, source = scontrol_job(job_id), "scontrol"
    if not fields:
        fields, source = sacct_job(job_id), "sacct"
    if fields:
        start, submit = timestamp(fields.get("StartTime", "")), timestamp(fields.get("SubmitTime", ""))
        return FinalRecord(job_id, fields.get("JobState", "UNKNOWN").split()[0], fields.get("ExitCode", "?"),
                           fields.get("NodeList", ""), duration_s(fields.get("RunTime", "")),
                           (start - submit).total_seconds() if start and submit else None,
                           fields.get("Reason", ""), source)
    record = exit_record(exit_file) if exit_file else None
    if record:
        code = int(record.get("exit_code", -1))
        return FinalRecord(job_id, SUCCESS if code == 0 else "FAILED", f"{code}:0", record.get("nodes", ""),
                           record.get("elapsed_s"), None, "", "exit record")
    return FinalRecord(job_id, "UNKNOWN", "?", "", None, None, "the scheduler no longer knows the job", "none")
