"""Runs whose process is gone, and the pool slots they hold.

A run killed with SIGKILL (or a lost machine) stays STARTED in the instance and keeps its pool
slots, so the next ``gpu`` or ``duckdb`` step would wait for it forever. A run counts as dead when
every process that logged for it is gone; it is then marked failed and its slots freed. That
happens by itself wherever a step waits for a slot (:func:`pool_slot` inside an asset, and
:data:`executor` for the pools declared on assets), with the daemon's run monitoring, or by hand
with ``eagle3 recover``. Process checks only mean something on the machine that ran the processes,
so they are made only where the instance launches runs as local processes.

The data needs no recovery: every asset resumes from what is on disk.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg

from eagle3_assets.processes import alive as _alive

ACTIVE = [dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.CANCELING]
BLOCKED = ("Step blocked by limit for pool ", "Step still blocked by limit for pool ")


def runs_are_local(instance: dg.DagsterInstance) -> bool:
    """Whether runs are processes on this machine (the default launcher), so their pids can be checked."""
    from dagster._core.launcher import DefaultRunLauncher

    return isinstance(instance.run_launcher, DefaultRunLauncher)


def is_dead(instance: dg.DagsterInstance, run: dg.DagsterRun) -> bool:
    """An active run whose logging processes have all exited on this machine."""
    if run.status not in ACTIVE:
        return False
    pids = {e.dagster_event.pid for e in instance.all_logs(run.run_id) if e.dagster_event and e.dagster_event.pid}
    return bool(pids) and not any(_alive(p) for p in pids)


def dead_runs(instance: dg.DagsterInstance) -> list[dg.DagsterRun]:
    """Active runs whose logging processes have all exited on this machine."""
    return [run for run in instance.get_runs(filters=dg.RunsFilter(statuses=ACTIVE)) if is_dead(instance, run)]


def _fail_and_free(instance: dg.DagsterInstance, run: dg.DagsterRun, by: str) -> None:
    instance.report_run_failed(run, message=f"process gone (killed or crashed); marked failed by {by}")
    if instance.event_log_storage.supports_global_concurrency_limits:
        instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)


def recover_dead_runs(instance: dg.DagsterInstance) -> list[str]:
    """Mark dead runs failed and free their pool slots; returns their run ids."""
    recovered = []
    for run in dead_runs(instance):
        _fail_and_free(instance, run, "`eagle3 recover`")
        recovered.append(run.run_id)
    return recovered


def free_dead_holders(instance: dg.DagsterInstance, pool: str, by: str = "a step waiting for its slot") -> list[str]:
    """Free the slots of ``pool`` held by runs that ended or whose process is gone; their run ids."""
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits or not runs_are_local(instance):
        return []
    freed = []
    for run_id in sorted({slot.run_id for slot in storage.get_concurrency_info(pool).claimed_slots}):
        run = instance.get_run_by_id(run_id)
        if run is None or run.is_finished:
            storage.free_concurrency_slots_for_run(run_id)
            freed.append(run_id)
        elif is_dead(instance, run):
            _fail_and_free(instance, run, by)
            freed.append(run_id)
    return freed


def holders(instance: dg.DagsterInstance, pool: str) -> str:
    """Who holds ``pool`` right now, for a log line."""
    slots = instance.event_log_storage.get_concurrency_info(pool).claimed_slots
    return ", ".join(f"run {s.run_id[:8]} ({s.step_key})" for s in slots) or "nobody"


@contextmanager
def pool_slot(context, pool: str, *, log_every_s: float = 60.0) -> Iterator[None]:
    """Hold one slot of ``pool`` for this step while the block runs, as a static ``pool=`` would,
    but only where the caller needs it: local and SGLang generation hold ``gpu``, API generation
    never waits for it. While waiting it says who holds the slot, and frees slots of dead runs."""
    instance = context.instance
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits:
        yield
        return
    info = storage.get_concurrency_info(pool)
    if info.limit is None:  # no limit on this pool: nothing to wait for
        yield
        return
    if info.using_default_limit or not info.slot_count:
        storage.initialize_concurrency_limit_to_default(pool)
    run_id, step_key = context.run.run_id, context.get_step_execution_context().step.key
    said = 0.0
    try:
        while True:
            status = storage.claim_concurrency_slot(pool, run_id, step_key)
            if status.is_claimed:
                break
            freed = free_dead_holders(instance, pool)
            if freed:
                context.log.warning(f"freed the '{pool}' slot of run(s) {', '.join(freed)}: their process is gone, "
                                    "so they were marked failed")
                continue
            if time.monotonic() - said >= log_every_s:
                said = time.monotonic()
                context.log.info(f"waiting for a '{pool}' slot (limit {info.limit}): held by {holders(instance, pool)}")
            time.sleep(status.sleep_interval or 2.0)
        context.log.info(f"holding a '{pool}' slot")
        yield
    finally:
        storage.free_concurrency_slot_for_step(run_id, step_key)


# -- the same for pools declared on assets: an executor that looks when a step is blocked ----------


class _FreesDeadSlots:
    """Wraps an executor: when a step reports it is blocked by a pool, slots held by dead runs are
    freed (the executor claims them on its next try) and who holds the pool is logged at INFO."""

    def __init__(self, inner):
        self.inner = inner

    @property
    def retries(self):
        return self.inner.retries

    @property
    def step_dependency_config(self):
        return self.inner.step_dependency_config

    def get_step_event_or_retry_event(self, *args, **kwargs):
        return self.inner.get_step_event_or_retry_event(*args, **kwargs)

    def execute(self, plan_context, execution_plan):
        instance = plan_context.instance
        for event in self.inner.execute(plan_context, execution_plan):
            yield event
            msg = event.message or ""
            prefix = next((p for p in BLOCKED if msg.startswith(p)), None)
            if event.event_type_value != "ENGINE_EVENT" or prefix is None:
                continue
            pool = msg[len(prefix):].strip()
            try:
                freed = free_dead_holders(instance, pool)
                if freed:
                    plan_context.log.warning(f"freed the '{pool}' slot of run(s) {', '.join(freed)}: their process "
                                             "is gone, so they were marked failed")
                else:
                    plan_context.log.info(f"step {event.step_key} waits for a '{pool}' slot: held by "
                                          f"{holders(instance, pool)}")
            except Exception as e:  # noqa: BLE001 - never break the run over a diagnostic
                plan_context.log.warning(f"could not look at the '{pool}' pool: {type(e).__name__}: {e}")


def _make_executor() -> dg.ExecutorDefinition:
    from dagster._core.executor.base import Executor

    base = dg.multi_or_in_process_executor

    class FreesDeadSlots(_FreesDeadSlots, Executor):
        pass

    return dg.ExecutorDefinition(
        name=base.name, config_schema=base.config_schema, requirements=base.get_requirements,
        executor_creation_fn=lambda init_context: FreesDeadSlots(base.executor_creation_fn(init_context)),
        description="Dagster's default executor; a step blocked by a pool frees slots held by runs whose process is gone.",
    )


executor = _make_executor()


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
