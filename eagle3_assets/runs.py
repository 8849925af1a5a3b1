"""Recovering from a killed run on this machine.

A run killed with SIGKILL (or a lost machine) stays STARTED in the instance and keeps its
pool slots, so the next ``gpu`` or ``duckdb`` step would wait forever. A run counts as dead
when every process that logged for it is gone; it is then marked failed and its slots freed.
The data needs no recovery: every asset resumes from what is on disk.
"""

from __future__ import annotations

import os

import dagster as dg

ACTIVE = [dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.CANCELING]


def _alive(pid: int) -> bool:
    """True while the process exists and is not a zombie waiting to be reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def dead_runs(instance: dg.DagsterInstance) -> list[dg.DagsterRun]:
    """Active runs whose logging processes have all exited on this machine."""
    out = []
    for run in instance.get_runs(filters=dg.RunsFilter(statuses=ACTIVE)):
        pids = {e.dagster_event.pid for e in instance.all_logs(run.run_id) if e.dagster_event and e.dagster_event.pid}
        if pids and not any(_alive(p) for p in pids):
            out.append(run)
    return out


def recover_dead_runs(instance: dg.DagsterInstance) -> list[str]:
    """Mark dead runs failed and free their pool slots; returns their run ids."""
    recovered = []
    for run in dead_runs(instance):
        instance.report_run_failed(run, message="process gone (killed or crashed); marked failed by `eagle3 recover`")
        if instance.event_log_storage.supports_global_concurrency_limits:
            instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
        recovered.append(run.run_id)
    return recovered


# Explicit pool limits (steps of all runs and backfills together): one GPU step at a time on
# this machine, one DuckDB writer, four OpenRouter callers. A limit already set (in the UI under
# Deployment -> Concurrency, or with `dagster instance concurrency set`) is left alone.
POOL_LIMITS = {"gpu": 1, "duckdb": 1, "openrouter": 4}


def ensure_pool_limits(instance, limits: dict[str, int] | None = None) -> dict[str, int]:
    """Set each pool's limit when the instance has none yet; returns what was set."""
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits:
        return {}
    existing = storage.get_concurrency_keys()
    changed = {}
    for pool, n in (limits or POOL_LIMITS).items():
        if pool not in existing:
            storage.set_concurrency_slots(pool, n)
            changed[pool] = n
    return changed
