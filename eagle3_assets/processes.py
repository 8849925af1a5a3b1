"""Whether a process is still there (Dagster-free: the run recovery and the key ledger both ask), and
how a child the project stops with SIGTERM is started."""

from __future__ import annotations

import os
import signal


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie waiting to be reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def default_sigterm() -> None:
    """``preexec_fn`` for a child the project stops with SIGTERM: SIGTERM's default action there.

    Dagster's in-process execution leaves SIGTERM set to SIGINT's disposition, and a process started
    with SIGINT ignored (under ``nohup``, ``cmd &`` in a script, many CI runners) therefore ends up
    ignoring SIGTERM. An ignored signal stays ignored across ``exec``, so every child started after
    would ignore its stop and be killed only when the grace ran out, with no chance to clean up."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
