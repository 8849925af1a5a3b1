"""kill -9 during ``raw_responses`` in a real Dagster CLI run, then re-run: every sample once, and
the killed run's pool slot is freed by the run that needs it, without ``eagle3 recover``."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3_assets.generation.response_store import ResponseStore
from tests.conftest import small_prompts, write_jsonl

pytestmark = pytest.mark.model
BIN = Path(sys.executable).parent


def dagster_materialize(env, select: str, partition: str, config: dict | None = None, log: Path | None = None):
    cmd = [str(BIN / "dagster"), "asset", "materialize", "-m", "eagle3_assets.definitions",
           "--select", select, "--partition", partition]
    if config:
        cmd += ["--config-json", json.dumps(config)]
    sink = open(log, "ab") if log else subprocess.DEVNULL
    return subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)


def complete_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def add_dataset(layout, monkeypatch, src: Path) -> dict:
    """``eagle3 add-dataset`` (its ``main``, in this process: setup, not under test) into the data
    root and its instance; the environment the Dagster CLI runs get."""
    from eagle3_assets.cli import main

    monkeypatch.setenv("DAGSTER_HOME", str(layout.dagster_home))
    assert main(["add-dataset", str(src)]) == 0
    return dict(os.environ, EAGLE3_HOME=str(layout.root), DAGSTER_HOME=str(layout.dagster_home))


def test_kill_minus_nine_mid_generation_then_rerun(layout, model_dir, tmp_path, monkeypatch):
    import dagster as dg

    from tests.support.dagster_helpers import run_dataset

    n = 8  # four batches of two: the kill lands after the second
    src = write_jsonl(tmp_path / "crash.jsonl", small_prompts(n))
    env = add_dataset(layout, monkeypatch, src)
    # the prompts table, materialized in this process on the same instance (setup, not under test)
    with dg.DagsterInstance.from_config(str(layout.dagster_home)) as instance:
        assert run_dataset(instance, "crash", selection=["prompts"], run_config={}).success

    config = {"ops": {"raw_responses": {"config": {"max_new_tokens": 16, "batch_size": 2}}}}
    out = layout.responses_dir("crash") / "local.jsonl"
    proc = dagster_materialize(env, "raw_responses", "crash", config)
    deadline = time.time() + 1200  # waits end as soon as the condition holds; long for loaded machines
    while complete_lines(out) < 4 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    written = complete_lines(out)
    assert 4 <= written < n, f"the kill should land mid-run ({written} of {n} written)"
    with out.open("ab") as fh:  # what a kill during a write leaves behind
        fh.write(b'{"sample_id": "s-torn", "dataset": "crash", "text": "half a li')

    # the killed run still holds the `gpu` pool slot: the re-run sees its process is gone and frees it
    log = tmp_path / "rerun.log"
    rerun = dagster_materialize(env, "raw_responses", "crash", config, log=log)
    assert rerun.wait(timeout=900) == 0, log.read_text()[-3000:]
    assert "freed the 'gpu' slot of run(s)" in log.read_text()
    rows = ResponseStore(layout.responses_dir("crash")).rows()
    ids = [r["sample_id"] for r in rows]
    assert len(ids) == n and len(set(ids)) == n
    assert sorted(r["prompt_id"] for r in rows) == sorted(f"q{i}" for i in range(n))
    assert out.read_bytes().endswith(b"\n") and b"s-torn" not in out.read_bytes()


HOLDER = """
import os, uuid
import dagster as dg
from dagster._core.events import DagsterEvent, EngineEventData
from dagster._core.storage.dagster_run import DagsterRun, DagsterRunStatus
instance = dg.DagsterInstance.get()
run = instance.add_run(DagsterRun(job_name="holder", run_id=str(uuid.uuid4()), status=DagsterRunStatus.STARTED))
event = DagsterEvent("ENGINE_EVENT", "holder", message="holding the duckdb pool", event_specific_data=EngineEventData({}),
                     pid=os.getpid())  # as a run worker logs: then this process exits, as if killed
instance.report_dagster_event(event, run.run_id)
assert instance.event_log_storage.claim_concurrency_slot("duckdb", run.run_id, "writer").is_claimed
print(run.run_id)
"""


def test_a_step_blocked_by_a_dead_runs_pool_slot_frees_it(layout, tmp_path, monkeypatch):
    """A pool declared on an asset (``inventory`` in ``duckdb``): the executor frees the slot of a
    run whose process is gone as soon as the step reports it is blocked."""
    src = write_jsonl(tmp_path / "held.jsonl", small_prompts(2))
    env = add_dataset(layout, monkeypatch, src)
    holder = subprocess.run([sys.executable, "-c", HOLDER], env=env, check=True, capture_output=True, text=True)
    dead_run = holder.stdout.strip()
    log = tmp_path / "inventory.log"
    proc = dagster_materialize(env, "inventory", "held", log=log)
    assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    assert f"freed the 'duckdb' slot of run(s) {dead_run}" in log.read_text()
