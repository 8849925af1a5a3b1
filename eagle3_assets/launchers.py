"""The places a GPU stage can run, behind one interface.

A stage writes its job file, describes its entry point as a :class:`Launch` (``python -m module
args``, plain or as a ``torchrun`` group, and the environment it needs), opens the configured
launcher with :func:`open_launcher` and calls its ``run`` once; the launcher decides how the
process starts (here through Pipes; on SLURM as one batch job) and returns the Pipes invocation.
``run`` blocks until the launch ends; a process that must run beside the step's own launch (the
streaming mode's producers beside its trainer) is started with ``start`` instead, which returns a
:class:`Started` handle at once (no Pipes session: such a process reports through its own files).

``LAUNCHERS`` is the registry, one line per launcher: its name and the ``module:attr`` of a
factory ``(context, config, layout) -> Launcher`` (resolved on first use, so this module imports
none of them). The stages' Dagster configs take ``LauncherName``, a typed choice built from it,
so a wrong name is refused by the config schema with the list of valid ones.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from eagle3_assets.processes import default_sigterm

LAUNCHERS = {
    "local": "eagle3_assets.launchers:LocalLauncher.open",  # this machine: one process, or torchrun
    "slurm": "eagle3_assets.slurm.launcher:SlurmLauncher.open",  # one SLURM job: torchrun under srun on every task
}
LauncherName = Literal[tuple(LAUNCHERS)]

# Variables a launch exports to its processes when the launching process has them: where the data
# and models live, offline hub settings, thread counts, the SGLang capture stand-in of the CPU tests.
FORWARDED_PREFIXES = ("EAGLE3_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def forwarded_env(environ=None) -> dict[str, str]:
    """The launching process's variables the launched processes need (see ``FORWARDED_PREFIXES``)."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in sorted(environ.items()) if k.startswith(FORWARDED_PREFIXES)}


@dataclass
class Launch:
    """A stage's entry point: ``python -m module args``, plain or under torchrun."""

    name: str  # the job's name (on a scheduler, one live job per name: a relaunch refuses a second)
    module: str
    args: list[str]
    procs: int | None = None  # None: one plain process; N: torchrun with N workers per task
    per_node: bool = False  # every task on its own: a plain process, or a standalone torchrun of procs workers
    exports: dict[str, str] = field(default_factory=dict)  # environment the process needs
    # a one-worker group on this machine runs as the plain process (the trainer: the same run, no
    # rendezvous); a cluster's launcher keeps torchrun, whose tasks may form one group together
    plain_when_alone: bool = False
    python: str = ""  # the interpreter ("": the launcher's own; another environment's needs the project on PYTHONPATH)


class Launcher(Protocol):
    """Where a stage's process runs. ``tasks`` and ``nodes`` are what the launch will get (a stage
    splits its work by them before writing the job file); ``here`` says the launch runs on this
    machine, so a stage whose work needs no process of its own may do it in the step instead."""

    tasks: int
    nodes: int
    here: bool

    def running(self, name: str) -> bool:
        """Whether a launch of that name is still alive (queued or running) from an earlier step."""

    def run(self, context, launch: Launch):
        """Run ``launch`` to its end through Dagster Pipes; the ``PipesClientCompletedInvocation``."""

    def start(self, context, launch: Launch, folder: Path) -> Started:
        """Start ``launch`` in the background and return at once; its files (output) go to ``folder``."""


class Started(Protocol):
    """A launch running beside the step (``Launcher.start``)."""

    log: Path  # where its output lands

    def poll(self) -> int | None:
        """None while it runs (or is queued); its exit code once it ended (non-zero: it failed)."""

    def queued(self) -> bool:
        """Whether it still waits to start (SLURM: pending in the queue); a process of this machine never does."""

    def stop(self, grace_s: float = 10.0) -> None:
        """End it: SIGTERM (SLURM: scancel), SIGKILL after ``grace_s``; returns once it ended."""


def get_factory(name: str):
    """The registered factory of launcher ``name`` (an unknown name: an error listing the valid ones)."""
    if name not in LAUNCHERS:
        raise ValueError(f"unknown launcher {name!r}; expected one of {sorted(LAUNCHERS)}")
    module, _, attr = LAUNCHERS[name].partition(":")
    target = importlib.import_module(module)
    for part in attr.split("."):
        target = getattr(target, part)
    return target


def open_launcher(name: str, context, config, layout) -> Launcher:
    """The launcher ``name`` for one step: ``config`` is the stage's Dagster config (a launcher reads
    its per-launch settings there, as SLURM reads ``config.slurm``), ``context.resources`` its
    cluster's resource, ``layout`` the data root its files go under."""
    return get_factory(name)(context, config, layout)


def local_command(launch: Launch) -> list[str]:
    """The command on this machine: the plain process, or a standalone torchrun of ``procs`` workers."""
    module = ["-m", launch.module, *launch.args]
    python = launch.python or sys.executable
    if launch.procs is None or (launch.procs == 1 and launch.plain_when_alone):
        return [python, *module]
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={launch.procs}", *module]


class LocalLauncher:
    """This machine, through ``PipesSubprocessClient``: one task on one node."""

    tasks = nodes = 1
    here = True

    @classmethod
    def open(cls, context, config, layout) -> LocalLauncher:
        return cls()

    def running(self, name: str) -> bool:
        return False  # a step's subprocess ends with its step

    def run(self, context, launch: Launch):
        import dagster as dg

        command = local_command(launch)
        context.log.info(f"{launch.name}: {' '.join(command)}")
        return dg.PipesSubprocessClient().run(context=context, command=command, env={**os.environ, **launch.exports})

    def start(self, context, launch: Launch, folder: Path) -> LocalStarted:
        command = local_command(launch)
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        log = folder / "output.log"
        context.log.info(f"{launch.name}: started {' '.join(command)} (output: {log})")
        with open(log, "a") as out:
            proc = subprocess.Popen(command, env={**os.environ, **launch.exports}, stdout=out, stderr=subprocess.STDOUT,
                                    preexec_fn=default_sigterm)  # stop() sends SIGTERM
        return LocalStarted(proc, log)


@dataclass
class LocalStarted:
    """A process of this machine started by :meth:`LocalLauncher.start`."""

    proc: subprocess.Popen
    log: Path

    def poll(self) -> int | None:
        return self.proc.poll()

    def queued(self) -> bool:
        return False

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait()


def wait_all(started: list, timeout_s: float, poll_s: float = 0.5) -> bool:
    """Until every started launch ended, at most ``timeout_s``; whether they all did."""
    deadline = time.monotonic() + timeout_s
    while any(s.poll() is None for s in started):
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True
