"""The batch script of one stage's job: resources, environment setup, and the stage's entry point.

A stage runs one plain process on the first node (extraction with the local or vLLM backend on
one node), one plain process on every task (the same extraction data-parallel over several
nodes, each task its share), or ``torchrun`` under ``srun`` on every task of the job (training,
SGLang extraction):
one torchrun agent per task, rendezvous (``c10d``) on the first host of the job's node list, so
``nodes x tasks_per_node`` agents of ``procs`` workers each form one process group.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# the stage's entry point this script runs, and the variables the job exports to its tasks
from eagle3_assets.launchers import FORWARDED_PREFIXES, Launch, forwarded_env  # noqa: F401


class JobResources(BaseModel):
    """What the job asks the scheduler for (empty or 0: the cluster's default)."""

    model_config = ConfigDict(extra="forbid")

    partition: str = ""
    account: str = ""
    qos: str = ""
    nodes: int = Field(1, ge=1)
    tasks_per_node: int = Field(1, ge=1)  # torchrun agents per node (1 on a real cluster)
    gpus_per_node: int = Field(0, ge=0)
    cpus_per_task: int = Field(0, ge=0)
    mem: str = ""  # per node, e.g. "512G"; "0" is the whole node
    time_limit: str = ""  # e.g. "24:00:00" or "2-00:00:00"
    sbatch_options: list[str] = []  # further `#SBATCH` lines, e.g. "--exclusive", "--constraint=h200"

    @property
    def tasks(self) -> int:
        return self.nodes * self.tasks_per_node


class JobEnvironment(BaseModel):
    """How a node gets the project's environment before the entry point starts."""

    model_config = ConfigDict(extra="forbid")

    modules: list[str] = []  # `module load` each, in order
    venv: str = ""  # a virtual environment on the shared filesystem, activated
    container: str = ""  # an image: apptainer (.sif) or pyxis/enroot (squashfs or registry URI)
    container_runtime: Literal["apptainer", "pyxis"] = "apptainer"
    container_mounts: list[str] = []  # host paths visible in the container (the data root is added)
    setup: list[str] = []  # further shell lines, e.g. "export NCCL_IB_HCA=mlx5"
    python: str = "python"  # the interpreter on the nodes
    srun_options: list[str] = []
    env: dict[str, str] = {}


def rendezvous_port(job_id_var: str = "SLURM_JOB_ID") -> str:
    """A port from the job id, so two jobs sharing a head node do not collide."""
    return f"$((20000 + ${job_id_var} % 20000))"


def entry_command(launch: Launch, python: str) -> list[str]:
    """The command every task runs (shell variables $EAGLE3_HEAD and $EAGLE3_PORT are the rendezvous);
    ``python``: the nodes' interpreter, unless the launch names its own."""
    python = launch.python or python
    if launch.procs is None:
        return [python, "-m", launch.module, *launch.args]
    if launch.per_node:  # a process group of its own on every task (node): nothing to meet across nodes
        return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={launch.procs}",
                "-m", launch.module, *launch.args]
    return [python, "-m", "torch.distributed.run", "--nnodes=$SLURM_NTASKS", f"--nproc-per-node={launch.procs}",
            "--rdzv-backend=c10d", "--rdzv-endpoint=$EAGLE3_HEAD:$EAGLE3_PORT", "--rdzv-id=eagle3-$SLURM_JOB_ID",
            "-m", launch.module, *launch.args]


def _word(arg: str) -> str:
    """Quote for the shell, leaving the script's own variables ($SLURM_..., $EAGLE3_...) to expand."""
    if "$" in arg:
        return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return shlex.quote(arg)


def render_script(launch: Launch, resources: JobResources, environment: JobEnvironment, job_dir: Path,
                  comment: str = "") -> str:
    """The whole batch script (its output goes to ``job_dir/slurm-<id>.out``)."""
    job_dir = Path(job_dir)
    r, e = resources, environment
    # --no-requeue: a job whose node fails ends (NODE_FAIL) and so does its Dagster step, with the
    # survivors' log; requeued, it would pend until the same number of nodes is up again, unseen
    directives = [f"--job-name={launch.name}", f"--output={job_dir}/slurm-%j.out", f"--nodes={r.nodes}",
                  f"--ntasks-per-node={r.tasks_per_node}", "--no-requeue"]
    for flag, value in (("partition", r.partition), ("account", r.account), ("qos", r.qos), ("mem", r.mem),
                        ("time", r.time_limit), ("comment", comment)):
        if value:
            directives.append(f"--{flag}={value}")
    if r.gpus_per_node:
        directives.append(f"--gpus-per-node={r.gpus_per_node}")
    if r.cpus_per_task:
        directives.append(f"--cpus-per-task={r.cpus_per_task}")
    directives += r.sbatch_options
    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives), "",
             "# environment setup (a failure here ends the job before the stage starts)", "set -e"]
    lines += [f"module load {shlex.quote(m)}" for m in e.modules]
    if e.venv:
        lines.append(f"source {shlex.quote(str(Path(e.venv) / 'bin' / 'activate'))}")
    lines += e.setup
    exports = {**launch.exports, **e.env, "PYTHONUNBUFFERED": "1"}
    lines += [f"export {k}={shlex.quote(str(v))}" for k, v in exports.items()]
    lines += ['EAGLE3_HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              f"EAGLE3_PORT={rendezvous_port()}", "export EAGLE3_HEAD EAGLE3_PORT", "set +e", "",
              'echo "eagle3: job $SLURM_JOB_ID on $SLURM_JOB_NUM_NODES node(s) [$SLURM_JOB_NODELIST], '
              '$SLURM_NTASKS task(s), head $EAGLE3_HEAD:$EAGLE3_PORT"']
    srun = ["srun", "--export=ALL", "--kill-on-bad-exit=1"]
    if launch.procs is None and not launch.per_node:
        srun += ["--nodes=1", "--ntasks=1"]
    srun += e.srun_options
    prefix: list[str] = []
    if e.container and e.container_runtime == "pyxis":
        mounts = ",".join(f"{m}:{m}" for m in e.container_mounts)
        srun += [f"--container-image={e.container}"] + ([f"--container-mounts={mounts}"] if mounts else [])
    elif e.container:
        prefix = ["apptainer", "exec"] + (["--nv"] if r.gpus_per_node else [])
        prefix += [f"--bind={','.join(e.container_mounts)}"] if e.container_mounts else []
        prefix.append(e.container)
    command = [*srun, *prefix, *entry_command(launch, e.python)]
    exit_file = job_dir / "exit-$SLURM_JOB_ID.json"
    lines += [" ".join(_word(a) for a in command), "status=$?",
              f'printf \'{{"job_id": "%s", "exit_code": %d, "nodes": "%s", "elapsed_s": %d}}\\n\' '
              f'"$SLURM_JOB_ID" "$status" "$SLURM_JOB_NODELIST" "$SECONDS" > {_word(str(exit_file))}',
              'echo "eagle3: exit code $status after ${SECONDS}s"', "exit $status", ""]
    return "\n".join(lines)
