"""``dagster dev`` (webserver and daemon) over a data root's own instance, on a free port: what
a user runs with ``eagle3 ui``, started and stopped by the UI tests and the seed-replay benchmark."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from eagle3_assets.graphql_client import DagsterWebserver
from eagle3_assets.paths import REPO_ROOT, DataLayout, ensure_dagster_home


@dataclass
class RunningDagster:
    server: DagsterWebserver
    instance: object  # dagster.DagsterInstance, the same one the webserver and daemon use
    layout: DataLayout
    proc: subprocess.Popen


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def dagster_dev(root: Path, env: dict[str, str] | None = None, timeout: float = 600) -> Iterator[RunningDagster]:
    """Start it with ``EAGLE3_HOME=root`` (plus ``env``), wait until the code location has loaded,
    stop the whole process group on the way out. Its output goes to ``root/dagster-dev.log``."""
    import dagster as dg

    from eagle3_assets.runs import ensure_pool_limits

    layout = DataLayout(root)
    home = ensure_dagster_home(layout)
    instance = dg.DagsterInstance.from_config(str(home))
    ensure_pool_limits(instance)
    port = free_port()
    full_env = dict(os.environ, DAGSTER_HOME=str(home), EAGLE3_HOME=str(root), **(env or {}))
    log = (Path(root) / "dagster-dev.log").open("wb")
    proc = subprocess.Popen([str(Path(sys.executable).with_name("dagster")), "dev", "-w", str(REPO_ROOT / "workspace.yaml"),
                             "-h", "127.0.0.1", "-p", str(port)], cwd=REPO_ROOT, env=full_env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    server = DagsterWebserver(f"http://127.0.0.1:{port}")
    try:
        server.wait_for_code_location(proc, timeout=timeout)
        yield RunningDagster(server, instance, layout, proc)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        log.close()
        instance.dispose()
