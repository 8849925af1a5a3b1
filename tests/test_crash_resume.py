"""kill -9 during ``raw_responses`` in a real Dagster CLI run, then re-run: every sample once."""

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


def test_kill_minus_nine_mid_generation_then_rerun(layout, model_dir, tmp_path):
    n = 16
    src = write_jsonl(tmp_path / "crash.jsonl", small_prompts(n))
    env = dict(os.environ, EAGLE3_HOME=str(layout.root), DAGSTER_HOME=str(layout.dagster_home))
    subprocess.run([str(BIN / "eagle3"), "add-dataset", str(src)], env=env, check=True, capture_output=True)
    assert dagster_materialize(env, "prompts", "crash").wait(timeout=300) == 0

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

    # the killed run still holds the `gpu` pool slot; recovering frees it
    recovered = subprocess.run([str(BIN / "eagle3"), "recover"], env=env, check=True, capture_output=True, text=True)
    assert "recovered 1 dead run" in recovered.stdout

    log = tmp_path / "rerun.log"
    rerun = dagster_materialize(env, "raw_responses", "crash", config, log=log)
    assert rerun.wait(timeout=900) == 0, log.read_text()[-3000:]
    rows = ResponseStore(layout.responses_dir("crash")).rows()
    ids = [r["sample_id"] for r in rows]
    assert len(ids) == n and len(set(ids)) == n
    assert sorted(r["prompt_id"] for r in rows) == sorted(f"q{i}" for i in range(n))
    assert out.read_bytes().endswith(b"\n") and b"s-torn" not in out.read_bytes()
