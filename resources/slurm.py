"""The SLURM cluster the GPU stages submit to when their run config says ``launcher: slurm``."""

import sys
from pathlib import Path

import dagster as dg

from eagle3_assets.paths import DataLayout


class SlurmJobConfig(dg.Config):
    """Per-launch overrides of the resource's job shape (0 or empty: the resource's)."""

    nodes: int = 0
    tasks_per_node: int = 0  # torchrun agents per node; >1 only to try several "nodes" on one machine
    gpus_per_node: int = 0
    cpus_per_task: int = 0
    mem: str = ""
    time_limit: str = ""
    sbatch_options: list[str] = []  # added to the resource's


class SlurmResource(dg.ConfigurableResource):
    """Where and how jobs run: the scheduler's queue (partition, account, QoS), the job's shape
    (nodes, GPUs and CPUs, memory, time limit), how a node gets the project's environment
    (modules, a venv or a container image on the shared filesystem, further setup lines), extra
    ``sbatch``/``srun`` options. The Dagster process needs SLURM's client commands (``sbatch``,
    ``squeue``, ``scontrol``, ``scancel``) and the same shared filesystem as the nodes: the data
    root, and ``job_root`` (default ``<data root>/slurm``) for scripts, logs and Pipes files."""

    partition: str = ""
    account: str = ""
    qos: str = ""
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 0
    mem: str = ""
    time_limit: str = ""
    sbatch_options: list[str] = []
    srun_options: list[str] = []
    modules: list[str] = []
    venv: str = ""
    container: str = ""
    container_runtime: str = "apptainer"  # or "pyxis" (srun --container-image)
    container_mounts: list[str] = []
    setup: list[str] = []
    python: str = ""  # the interpreter on the nodes (default: the venv's, "python" in a container, else this one)
    vllm_python: str = ""  # hidden_states with backend vllm: the vLLM environment's interpreter on the nodes
    env: dict[str, str] = {}
    job_root: str = ""
    poll_interval_s: float = 5.0

    def job_resources(self, overrides: SlurmJobConfig | None = None):
        from eagle3_assets.slurm.script import JobResources

        o = overrides or SlurmJobConfig()
        return JobResources(partition=self.partition, account=self.account, qos=self.qos,
                            nodes=o.nodes or self.nodes, tasks_per_node=o.tasks_per_node or self.tasks_per_node,
                            gpus_per_node=o.gpus_per_node or self.gpus_per_node,
                            cpus_per_task=o.cpus_per_task or self.cpus_per_task, mem=o.mem or self.mem,
                            time_limit=o.time_limit or self.time_limit,
                            sbatch_options=[*self.sbatch_options, *o.sbatch_options])

    def job_environment(self, layout: DataLayout):
        from eagle3_assets.slurm.script import JobEnvironment

        python = self.python or (str(Path(self.venv) / "bin" / "python") if self.venv else
                                 "python" if self.container else sys.executable)
        mounts = list(dict.fromkeys([*self.container_mounts, str(layout.root), str(self.root(layout))]))
        return JobEnvironment(modules=self.modules, venv=self.venv, container=self.container,
                              container_runtime=self.container_runtime, container_mounts=mounts, setup=self.setup,
                              python=python, srun_options=self.srun_options, env=self.env)

    def root(self, layout: DataLayout) -> Path:
        return Path(self.job_root) if self.job_root else layout.root / "slurm"

    def client(self, layout: DataLayout, overrides: SlurmJobConfig | None = None):
        """A :class:`~eagle3_assets.slurm.pipes_client.PipesSlurmClient` for one launch."""
        from eagle3_assets.slurm.pipes_client import PipesSlurmClient

        return PipesSlurmClient(self.job_resources(overrides), self.job_environment(layout), self.root(layout),
                                poll_interval_s=self.poll_interval_s)
