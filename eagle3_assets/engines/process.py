"""What every engine server the project starts needs: a free port, its log's tail, a clean stop."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def stop_group(proc: subprocess.Popen | None, grace_s: float = 60.0) -> None:
    """SIGTERM to a server's process group (API server, engine core, workers), then SIGKILL; workers
    left in the group after the leader exited are killed too."""
    if proc is None:
        return
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


class ServerProcess:
    """The lifecycle both engine servers share: wait until a readiness URL answers 200 (or the process
    dies), stop the process group and remove a private working folder, and the context manager.
    A subclass (a dataclass) has ``_proc``, ``_own_workdir``, ``workdir`` and ``log_path``."""

    engine = "engine"  # the name in messages
    error: type[RuntimeError] = RuntimeError
    ready_probe_timeout_s = 10.0

    def ready_url(self) -> str:
        raise NotImplementedError

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def wait_ready(self, timeout_s: float = 1800.0):
        """Until :meth:`ready_url` answers 200; the generous default survives a slow, shared machine."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                raise self.error(f"the {self.engine} server exited ({code}) before it was ready; "
                                 f"last lines of {self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(self.ready_url(), timeout=self.ready_probe_timeout_s).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise self.error(f"the {self.engine} server was not ready after {timeout_s:.0f} s; "
                                 f"last lines of its log:\n{self.log_tail()}")
            time.sleep(1.0)

    def stop(self, grace_s: float = 60.0) -> None:
        proc, self._proc = self._proc, None
        stop_group(proc, grace_s)
        if self._own_workdir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self):
        self.start()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
