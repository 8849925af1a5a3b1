"""Run-failure alerts: every failed run becomes one JSON line in ``alerts.jsonl`` and a log line.

Where the alert goes is pluggable: anything with ``send(alert: dict) -> None`` is an
:class:`AlertSink`. The default appends to the ``alerts.jsonl`` of the ``storage`` resource's data
root (the one the run wrote to, whatever ``storage.root`` is set to); a Slack or PagerDuty
sink is a few lines (and should read its token from the environment, never from the alert).
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol, runtime_checkable

import dagster as dg

from eagle3_assets.resources import StorageResource

MAX_MESSAGE = 2000
# Keys whose values never go into an alert, wherever they appear in a message.
SECRET_ENV = ("OPENROUTER_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


@runtime_checkable
class AlertSink(Protocol):
    def send(self, alert: dict) -> None: ...


class FileAlertSink:
    """Appends each alert as one JSON line (fsync'd) to a file."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def send(self, alert: dict) -> None:
        path = self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(alert, sort_keys=True, default=str) + "\n")
            fh.flush()
            os.fsync(fh.fileno())


def _redact(text: str) -> str:
    for name in SECRET_ENV:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return text[:MAX_MESSAGE]


def _error_message(event) -> str:
    if event is None:
        return ""
    data = getattr(event, "event_specific_data", None)
    error = getattr(data, "error", None)
    if error is not None:
        msg = getattr(error, "message", "") or ""
        cause = getattr(error, "cause", None)
        while cause is not None:
            msg += f" (caused by {cause.cls_name}: {cause.message.strip()})"
            cause = getattr(cause, "cause", None)
        return msg.strip()
    return getattr(event, "message", "") or ""


def build_alert(context) -> dict:
    """The alert for a run-failure context: identifiers and messages, never config or resources."""
    run = context.dagster_run
    steps = []
    for ev in context.get_step_failure_events():
        steps.append({"step": ev.step_key, "error": _redact(_error_message(ev))})
    return {
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
        "kind": "run_failure",
        "run_id": run.run_id,
        "job": run.job_name,
        "partition": run.tags.get("dagster/partition"),
        "backfill": run.tags.get("dagster/backfill"),
        "step_failures": steps,
        "error": _redact(_error_message(context.failure_event)),
    }


def make_run_failure_alert_sensor(sink: AlertSink | None = None, name: str = "run_failure_alerts"):
    """Without ``sink``, alerts go to ``alerts.jsonl`` under the ``storage`` resource's data root."""

    @dg.run_failure_sensor(
        name=name,
        monitor_all_code_locations=False,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Appends an alert (run, job, partition, failed steps, error) to alerts.jsonl for every failed run.",
    )
    def _sensor(context: dg.RunFailureSensorContext, storage: StorageResource):
        alert = build_alert(context)
        (sink or FileAlertSink(storage.layout.alerts_file)).send(alert)
        context.log.error(
            f"run {alert['run_id'][:8]} of {alert['job']} failed"
            f"{' for partition ' + alert['partition'] if alert['partition'] else ''}: "
            f"{', '.join(s['step'] for s in alert['step_failures']) or 'no step failed'}; {alert['error'][:200]}"
        )

    return _sensor


run_failure_alerts = make_run_failure_alert_sensor()
