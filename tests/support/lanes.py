"""`make test`: the suite as two pytest processes at once.

On a 2-core machine one pytest process leaves the CPU idle about half the time: much of the
integration tests' wall time is waiting (an engine server importing torch and starting, SLURM
scheduling a job, Dagster's backfill daemon on its 30-second loop). Two lanes fill it:

- ``engines``: the vLLM, SGLang, pipeline and packaging tests, which share the session's small
  drafters and demo datasets (trained and generated once, in this lane); printed as they run;
- ``rest``: the unit tests, Dagster's UI and crash tests and the SLURM clusters, which share no
  session fixture with the first; their output is kept in a file and printed when both have ended.

Each lane is its own pytest process (its own session fixtures and torch threads); they share only
the files of the model cache, built here once before either starts. The exit status is the
``engines`` lane's if it failed, else the ``rest`` lane's. Every test file sits in exactly one lane
(``tests/unit/project/test_test_layout.py`` checks it).

    python -m tests.support.lanes [PYTEST_ARGS...]   # PYTEST_ARGS go to both lanes

Plain ``pytest`` still runs the whole suite in one process.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LANES = {
    "engines": ["tests/integration/vllm", "tests/integration/sglang", "tests/integration/pipeline",
                "tests/integration/packaging", "tests/integration/gpu"],
    "rest": ["tests/unit", "tests/integration/dagster", "tests/integration/slurm"],
}


def build_model_cache() -> None:
    """The converted models both lanes read, built here once so the lanes never both build them."""
    from eagle3_assets.target.embedded import ensure_default_model
    from eagle3_assets.target.kimi_mini import ensure_kimi_mini
    from tests.conftest import MODEL_CACHE  # the suite's cache (importing it sets the offline environment)

    print(f"model cache: {ensure_default_model(MODEL_CACHE)}, {ensure_kimi_mini(MODEL_CACHE)}", flush=True)


def lane_command(lane: str, args: list[str]) -> list[str]:
    """One lane's pytest; only the first lane keeps pytest's cache, so they never write it at once."""
    cache = [] if lane == "engines" else ["-p", "no:cacheprovider"]
    return [sys.executable, "-m", "pytest", *LANES[lane], *cache, *args]


def run(args: list[str]) -> int:
    build_model_cache()
    with tempfile.TemporaryDirectory(prefix="eagle3-lane-") as tmp:
        log_path = Path(tmp) / "rest.log"
        with log_path.open("wb") as log:
            rest = subprocess.Popen(lane_command("rest", args), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            try:
                print(f"lane rest ({' '.join(LANES['rest'])}): in the background (pid {rest.pid}), "
                      "its output after this lane's", flush=True)
                print(f"lane engines ({' '.join(LANES['engines'])}):", flush=True)
                engines = subprocess.call(lane_command("engines", args), cwd=ROOT)
                rest_status = rest.wait()
            finally:
                if rest.poll() is None:  # interrupted: the background lane does not outlive the run
                    rest.terminate()
                    rest.wait()
        print(f"\n===== lane rest ({' '.join(LANES['rest'])}) =====", flush=True)
        sys.stdout.buffer.write(log_path.read_bytes())
        sys.stdout.flush()
    print(f"\nlanes: engines exit {engines}, rest exit {rest_status}", flush=True)
    return engines or rest_status


if __name__ == "__main__":
    raise SystemExit(run(sys.argv[1:]))
