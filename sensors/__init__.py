"""Sensors: new prompt files become dataset partitions; failed runs become alerts."""

from .alerts import AlertSink, FileAlertSink, build_alert, make_run_failure_alert_sensor, run_failure_alerts
from .prompt_files import prompt_files_sensor

__all__ = ["AlertSink", "FileAlertSink", "build_alert", "make_run_failure_alert_sensor", "prompt_files_sensor",
           "run_failure_alerts"]
