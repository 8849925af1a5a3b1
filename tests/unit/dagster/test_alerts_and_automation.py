"""The run-failure alert sensor, the automation conditions and the pool limits."""

import json

import dagster as dg
import pytest

from eagle3_assets.definitions import defs
from eagle3_assets.partitions import datasets_partitions
from eagle3_assets.resources import StorageResource
from eagle3_assets.sensors import AlertSink, FileAlertSink, make_run_failure_alert_sensor, run_failure_alerts


class MemorySink:
    def __init__(self):
        self.alerts = []

    def send(self, alert: dict) -> None:
        self.alerts.append(alert)


@dg.asset(partitions_def=datasets_partitions)
def broken(context) -> None:
    raise RuntimeError(f"disk full while writing {context.partition_key}")


def _failure_context(instance, monkeypatch, secret="sk-or-very-secret-key", storage=None):
    monkeypatch.setenv("OPENROUTER_API_KEY", secret)

    @dg.asset(partitions_def=datasets_partitions)
    def leaky(context) -> None:
        raise RuntimeError(f"request failed with key {secret}")

    instance.add_dynamic_partitions(datasets_partitions.name, ["alpha"])
    result = dg.materialize([broken, leaky], partition_key="alpha", instance=instance, raise_on_error=False)
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type == dg.DagsterEventType.RUN_FAILURE)
    run = instance.get_run_by_id(result.run_id)
    ctx = dg.build_run_status_sensor_context(
        sensor_name="run_failure_alerts", dagster_event=failure, dagster_instance=instance, dagster_run=run,
        resources={"storage": storage or StorageResource()},
    ).for_run_failure()
    return ctx, result.run_id


def test_failed_run_becomes_an_alert_line_without_secrets(layout, monkeypatch):
    with dg.instance_for_test() as instance:
        ctx, run_id = _failure_context(instance, monkeypatch)
        run_failure_alerts(ctx)
    lines = layout.alerts_file.read_text().splitlines()
    assert len(lines) == 1
    alert = json.loads(lines[0])
    assert alert["run_id"] == run_id and alert["kind"] == "run_failure"
    assert alert["partition"] == "alpha" and alert["job"] == "__ephemeral_asset_job__"
    steps = {s["step"]: s["error"] for s in alert["step_failures"]}
    assert set(steps) == {"broken", "leaky"}
    assert "disk full while writing alpha" in steps["broken"]
    assert "sk-or-very-secret-key" not in lines[0] and "***" in steps["leaky"]
    assert alert["error"]


def test_alerts_go_under_the_storage_resources_root_not_the_environments(layout, monkeypatch, tmp_path):
    """The storage resource is the data root's one source: with its root set elsewhere than
    $EAGLE3_HOME, the failed run's alert lands under that root and nothing is written under the other."""
    configured = tmp_path / "configured-root"
    with dg.instance_for_test() as instance:
        ctx, run_id = _failure_context(instance, monkeypatch, storage=StorageResource(root=str(configured)))
        run_failure_alerts(ctx)
    lines = (configured / "alerts.jsonl").read_text().splitlines()
    assert [json.loads(line)["run_id"] for line in lines] == [run_id]
    assert not layout.alerts_file.exists()


def test_alert_sink_is_pluggable(layout, monkeypatch):
    sink = MemorySink()
    assert isinstance(sink, AlertSink) and isinstance(FileAlertSink(layout.alerts_file), AlertSink)
    sensor = make_run_failure_alert_sensor(sink, name="memory_alerts")
    with dg.instance_for_test() as instance:
        ctx, run_id = _failure_context(instance, monkeypatch)
        sensor(ctx)
    assert [a["run_id"] for a in sink.alerts] == [run_id]
    assert not layout.alerts_file.exists()


def test_sensors_are_registered():
    names = {s.name for s in defs.sensors}
    assert {"prompt_files_sensor", "run_failure_alerts"} <= names


def test_prompt_files_sensor_requests_prompts_and_responses(layout):
    from eagle3_assets.resources import StorageResource
    from eagle3_assets.sensors import prompt_files_sensor
    from tests.conftest import small_prompts, write_jsonl

    write_jsonl(layout.prompt_source("alpha"), small_prompts(1))
    with dg.instance_for_test() as instance:
        ctx = dg.build_sensor_context(instance=instance, definitions=defs, resources={"storage": StorageResource()})
        result = prompt_files_sensor(ctx)
    (req,) = result.run_requests
    assert req.partition_key == "alpha"
    assert {k.to_user_string() for k in req.asset_selection} == {"prompts", "raw_responses"}


@pytest.mark.parametrize("name", ["token_ids", "inventory", "merged_corpus"])
def test_cpu_stages_are_eager_behind_blocking_checks(name):
    cond = defs.resolve_asset_graph().get(dg.AssetKey(name)).automation_condition
    assert cond is not None
    labels = {c.label for c in cond.operands}
    assert labels == {"eager", "all_deps_blocking_checks_passed"} or (
        "all_deps_blocking_checks_passed" in str(cond) and "eager" in str(cond))


@pytest.mark.parametrize("name", ["prompts", "raw_responses", "hidden_states", "drafter_checkpoint"])
def test_other_stages_never_start_by_themselves(name):
    assert defs.resolve_asset_graph().get(dg.AssetKey(name)).automation_condition is None


def test_pool_limits_are_set_once_and_never_overwritten():
    from eagle3_assets.runs import POOL_LIMITS, ensure_pool_limits

    with dg.instance_for_test() as instance:
        storage = instance.event_log_storage
        storage.set_concurrency_slots("openrouter", 8)  # an operator's choice
        assert ensure_pool_limits(instance) == {"gpu": 1, "duckdb": 1}
        assert ensure_pool_limits(instance) == {}
        slots = {k: storage.get_concurrency_info(k).slot_count for k in POOL_LIMITS}
        assert slots == {"gpu": 1, "duckdb": 1, "openrouter": 8}
