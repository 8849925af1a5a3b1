"""A real one-node SLURM cluster in a private folder: munged, slurmctld and slurmd from Debian's
``slurm-wlm`` and ``munge`` packages, for the tests marked ``slurm`` and for trying the SLURM
launcher on one machine. Run as root (slurmd starts jobs as their user).

    python -m eagle3_assets.testing.slurm_cluster up DIR     # start; prints `export SLURM_CONF=...`
    python -m eagle3_assets.testing.slurm_cluster down DIR   # cancel every job, stop the daemons
    python -m eagle3_assets.testing.slurm_cluster check      # start, run `srun -n2`, stop (exit 1 on failure)

Everything lives under DIR (and a folder in /tmp for the sockets and pid files): a generated munge
key and its own munged socket (the config's ``AuthInfo``), ports picked free, state, spool and log
files; nothing in /etc is read or
written, so it runs beside a system munge or SLURM. Accounting is off (no slurmdbd): ``sacct``
knows nothing and jobs are followed with ``squeue``/``scontrol``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from eagle3_assets.runs import _alive as process_alive  # zombie-aware: munged leaves zombies

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo", "munge")


class SlurmClusterError(RuntimeError):
    """The daemons did not start; the message carries their logs."""


def missing_binaries() -> list[str]:
    return [b for b in (*DAEMONS, *CLIENTS) if shutil.which(b) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_hardware() -> tuple[str, int, int]:
    """(node name, CPUs, memory MB) as slurmd itself sees them (``slurmd -C``)."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30).stdout
    fields = dict(re.findall(r"(\w+)=(\S+)", out))
    return fields.get("NodeName", socket.gethostname().split(".")[0]), int(fields["CPUs"]), int(fields["RealMemory"])


@dataclass
class LocalSlurm:
    root: Path
    node: str
    cpus: int
    memory_mb: int

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def run_dir(self) -> Path:
        """Sockets and pid files: munged wants every folder above its socket open to all, which a
        private temporary folder (pytest's, mkdtemp's) is not, so they live in /tmp by name."""
        import hashlib

        return Path(tempfile.gettempdir()) / f"eagle3-slurm-{hashlib.sha1(str(self.root).encode()).hexdigest()[:10]}"

    @property
    def socket(self) -> Path:
        return self.run_dir / "munge.socket"

    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env={**os.environ, **self.env()})

    def logs(self, lines: int = 20) -> str:
        parts = []
        for f in sorted((self.root / "log").glob("*.log")):
            text = f.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {f.name}\n" + "\n".join(text))
        return "\n".join(parts)

    def jobs(self) -> list[str]:
        """Every job the scheduler still has queued or running."""
        res = self.run("squeue", "-h", "-o", "%i")
        return res.stdout.split()


def write_config(root: Path, node: str, cpus: int, memory_mb: int) -> LocalSlurm:
    cluster = LocalSlurm(root, node, cpus, memory_mb)
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    cluster.run_dir.mkdir(exist_ok=True)
    os.chmod(root / "munge", 0o700)  # munged refuses a key others could read...
    os.chmod(cluster.run_dir, 0o755)  # ...and a socket others cannot reach
    key = root / "munge" / "munge.key"
    if not key.exists():
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
    usable = int(memory_mb * 0.9)  # below what slurmd reports, or it drains the node
    cluster.conf.write_text(f"""\
ClusterName=eagle3local
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={cluster.socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={cluster.run_dir}/slurmctld.pid
SlurmdPidFile={cluster.run_dir}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
MinJobAge=600
KillWait=10
DefMemPerCPU={usable // max(1, cpus)}
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={usable} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
""")
    return cluster


def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int | None) -> bool:
    return pid is not None and process_alive(pid)


def start(root: Path, timeout: float = 60.0) -> LocalSlurm:
    """Start munged, slurmctld and slurmd under ``root`` and wait until the node takes jobs."""
    missing = missing_binaries()
    if missing:
        raise SlurmClusterError(f"not installed: {', '.join(missing)} (apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        raise SlurmClusterError("the local SLURM cluster runs as root (slurmd starts jobs as their user)")
    root = Path(root).resolve()
    cluster = write_config(root, *node_hardware())
    env = {**os.environ, **cluster.env()}
    commands = [
        ["munged", f"--socket={cluster.socket}", f"--key-file={root}/munge/munge.key", f"--pid-file={cluster.run_dir}/munged.pid",
         f"--log-file={root}/log/munged.log", f"--seed-file={root}/munge/munged.seed"],
        ["slurmctld", "-f", str(cluster.conf)],
        ["slurmd", "-f", str(cluster.conf), "-N", cluster.node],
    ]
    for cmd in commands:
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
        if res.returncode != 0:
            stop(cluster)
            raise SlurmClusterError(f"{cmd[0]} did not start ({res.returncode}): {res.stderr.strip()}\n{cluster.logs()}")
    deadline = time.monotonic() + timeout
    while True:
        state = cluster.run("sinfo", "-h", "-n", cluster.node, "-o", "%T").stdout.strip()
        if state in ("idle", "mixed", "allocated"):
            return cluster
        if time.monotonic() > deadline:
            stop(cluster)
            raise SlurmClusterError(f"the node is {state or 'unknown'} after {timeout:.0f} s\n{cluster.logs()}")
        time.sleep(0.5)


def stop(cluster: LocalSlurm, timeout: float = 30.0) -> None:
    """Cancel every job, stop the daemons this folder's pid files name (never others), wait for them."""
    pids = {name: _pid(cluster.run_dir / f"{name}.pid") for name in ("slurmd", "slurmctld", "munged")}
    if _alive(pids["slurmctld"]):
        with contextlib.suppress(subprocess.TimeoutExpired):
            cluster.run("scancel", "-u", "root", timeout=20)
            deadline = time.monotonic() + timeout
            while cluster.jobs() and time.monotonic() < deadline:
                time.sleep(0.5)
    for name in ("slurmd", "slurmctld", "munged"):
        pid = pids[name]
        if not _alive(pid):
            continue
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(cluster.run_dir, ignore_errors=True)


@contextlib.contextmanager
def local_slurm(root: Path) -> Iterator[LocalSlurm]:
    cluster = start(root)
    try:
        yield cluster
    finally:
        stop(cluster)


def check(root: Path) -> int:
    """Start the cluster, run a two-task step and a batch job, stop it; 0 when all of it worked."""
    try:
        with local_slurm(root) as cluster:
            step = cluster.run("srun", "-N1", "-n2", "hostname", timeout=120)
            if step.returncode != 0 or len(step.stdout.split()) != 2:
                print(f"srun -n2 failed: {step.stderr.strip()}\n{cluster.logs()}", file=sys.stderr)
                return 1
            job = cluster.run("sbatch", "--parsable", "-n1", "-o", "/dev/null", "--wrap", "true").stdout.strip()
            deadline = time.monotonic() + 120
            state = ""
            while time.monotonic() < deadline and state not in ("COMPLETED", "FAILED", "CANCELLED"):
                time.sleep(0.5)
                state = cluster.run("squeue", "-h", "-t", "all", "-j", job, "-o", "%T").stdout.strip()
            if state != "COMPLETED":
                print(f"sbatch job {job or '(none)'} ended {state or 'unknown'}\n{cluster.logs()}", file=sys.stderr)
                return 1
            print(f"SLURM works here: one node {cluster.node} ({cluster.cpus} CPUs, {cluster.memory_mb} MB); "
                  f"srun -n2 ran 2 tasks, sbatch job {job} COMPLETED", flush=True)
    except SlurmClusterError as exc:
        print(f"SLURM cannot start here: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m eagle3_assets.testing.slurm_cluster", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("up", "down", "check"))
    ap.add_argument("dir", nargs="?", default="")
    args = ap.parse_args(argv)
    if args.action == "check":
        with tempfile.TemporaryDirectory(prefix="eagle3-slurm-") as tmp:
            return check(Path(args.dir or tmp))
    if not args.dir:
        ap.error(f"{args.action} needs the cluster's folder")
    root = Path(args.dir).resolve()
    if args.action == "up":
        try:
            cluster = start(root)
        except SlurmClusterError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"export SLURM_CONF={cluster.conf}")
        return 0
    stop(LocalSlurm(root, "", 0, 0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
