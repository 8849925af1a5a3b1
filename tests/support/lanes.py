"""`make test`: the suite as two pytest processes at once, the unit tests beside the integration tests.

The integration tests spend much of their wall time waiting (an engine server importing torch and
starting, SLURM scheduling a job, Dagster's backfill daemon on its 30-second loop), so on a 2-core
machine the unit tests fit largely into that idle time instead of running after it. Each lane is its
own pytest process (its own session fixtures and torch threads, no shared state but the files of
the model cache, built once before either starts). The integration lane prints as it goes; the
unit lane's output is kept in a file and printed when both have ended. The exit status is the
integration lane's if it failed, else the unit lane's.

    python -m tests.support.lanes [PYTEST_ARGS...]   # PYTEST_ARGS go to both lanes

Plain ``pytest`` still runs the whole suite in one process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LANES = {"integration": "tests/integration", "unit": "tests/unit"}


def build_model_cache() -> None:
    """The converted models both lanes read, built here once so the lanes never both build them."""
    from eagle3_assets.target.embedded import ensure_default_model
    from eagle3_assets.target.kimi_mini import ensure_kimi_mini
    from tests.conftest import MODEL_CACHE  # the suite's cache (importing it sets the offline environment)

    print(f"model cache: {ensure_default_model(MODEL_CACHE)}, {ensure_kimi_mini(MODEL_CACHE)}", flush=True)


def lane_command(folder: str, args: list[str], *, cache: bool) -> list[str]:
    """One lane's pytest; only one lane keeps pytest's cache, so they never write it at once."""
    return [sys.executable, "-m", "pytest", folder, *([] if cache else ["-p", "no:cacheprovider"]), *args]


def run(args: list[str]) -> int:
    build_model_cache()
    with tempfile.TemporaryDirectory(prefix="eagle3-unit-lane-") as tmp:
        log_path = Path(tmp) / "unit.log"
        with log_path.open("wb") as log:
            unit = subprocess.Popen(lane_command(LANES["unit"], args, cache=False), cwd=ROOT,
                                    stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
            try:
                print(f"unit lane: {LANES['unit']} in the background (pid {unit.pid}), its output after this lane's",
                      flush=True)
                integration = subprocess.call(lane_command(LANES["integration"], args, cache=True), cwd=ROOT)
                unit_status = unit.wait()
            finally:
                if unit.poll() is None:  # interrupted: the unit lane does not outlive the run
                    unit.terminate()
                    unit.wait()
        print(f"\n===== unit lane ({LANES['unit']}) =====", flush=True)
        sys.stdout.buffer.write(log_path.read_bytes())
        sys.stdout.flush()
    print(f"\nlanes: integration exit {integration}, unit exit {unit_status}", flush=True)
    return integration or unit_status


if __name__ == "__main__":
    raise SystemExit(run(sys.argv[1:]))
