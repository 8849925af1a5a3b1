"""A real one-node SLURM cluster in a private folder: munged, slurmctld and slurmd from Debian's
``slurm-wlm`` and ``munge`` packages, for the tests marked ``slurm`` and for trying the SLURM
launcher on one machine. Run as root (slurmd starts jobs as their user).

    python -m tests.support.slurm_cluster up DIR     # start; prints `export SLURM_CONF=...`
    python -m tests.support.slurm_cluster down DIR   # cancel every job, stop the daemons
    python -m tests.support.slurm_cluster check      # start, run `srun -n2`, stop (exit 1 on failure)

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


def write_config(root: Path, node: str, cpus: int, memory_mb: int, *, nodes: list[tuple[str, str]] | None = None,
                 controller_addr: str = "127.0.0.1") -> LocalSlurm:
    """The folder and ``slurm.conf`` of a cluster whose controller is ``node`` at ``controller_addr``;
    its compute nodes are ``nodes`` (name, address), by default ``node`` itself on the loopback,
    each given ``cpus`` and an equal share of ``memory_mb``."""
    cluster = LocalSlurm(root, node, cpus, memory_mb)
    nodes = nodes or [(node, "127.0.0.1")]
    several = len(nodes) > 1  # one slurmd per node on this machine: its pid, log and spool named by %n
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    cluster.run_dir.mkdir(exist_ok=True)
    os.chmod(root / "munge", 0o700)  # munged refuses a key others could read...
    os.chmod(cluster.run_dir, 0o755)  # ...and a socket others cannot reach
    key = root / "munge" / "munge.key"
    if not key.exists():
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
    usable = int(memory_mb * 0.9) // len(nodes)  # below what slurmd reports, or it drains the node
    per_node = "-%n" if several else ""
    node_lines = "\n".join(f"NodeName={name} NodeAddr={addr} CPUs={cpus} RealMemory={usable} State=UNKNOWN"
                           for name, addr in nodes)
    cluster.conf.write_text(f"""\
ClusterName=eagle3local
SlurmctldHost={node}({controller_addr})
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={cluster.socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool{per_node}
SlurmctldPidFile={cluster.run_dir}/slurmctld.pid
SlurmdPidFile={cluster.run_dir}/slurmd{per_node}.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd{per_node}.log
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
{node_lines}
PartitionName=debug Nodes={",".join(name for name, _ in nodes)} Default=YES MaxTime=INFINITE State=UP
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
    start_daemons(cluster, [["slurmd", "-f", str(cluster.conf), "-N", cluster.node]])
    wait_for_nodes(cluster, [cluster.node], timeout)
    return cluster


def start_daemons(cluster: LocalSlurm, slurmd_commands: list[list[str]]) -> None:
    """munged and slurmctld here, then each slurmd command; stops what started when one fails."""
    root, env = cluster.root, {**os.environ, **cluster.env()}
    commands = [
        ["munged", f"--socket={cluster.socket}", f"--key-file={root}/munge/munge.key", f"--pid-file={cluster.run_dir}/munged.pid",
         f"--log-file={root}/log/munged.log", f"--seed-file={root}/munge/munged.seed"],
        ["slurmctld", "-f", str(cluster.conf)],
        *slurmd_commands,
    ]
    for cmd in commands:
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
        if res.returncode != 0:
            stop(cluster)
            what = f"slurmd -N {cmd[-1]}" if "slurmd" in cmd else cmd[0]
            raise SlurmClusterError(f"{what} did not start ({res.returncode}): {res.stderr.strip()}\n{cluster.logs()}")


def wait_for_nodes(cluster: LocalSlurm, nodes: list[str], timeout: float = 60.0) -> None:
    """Until every node takes jobs; stops the cluster and says which did not."""
    deadline = time.monotonic() + timeout
    while True:
        out = cluster.run("sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %T").stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        if all(states.get(n) in ("idle", "mixed", "allocated") for n in nodes):
            return
        if time.monotonic() > deadline:
            stop(cluster)
            shown = ", ".join(f"{n} {states.get(n, 'unknown')}" for n in nodes)
            raise SlurmClusterError(f"nodes not ready after {timeout:.0f} s: {shown}\n{cluster.logs()}")
        time.sleep(0.5)


def stop(cluster: LocalSlurm, timeout: float = 30.0) -> None:
    """Cancel every job, stop the daemons this folder's pid files name (never others), wait for them."""
    pids = {name: _pid(cluster.run_dir / f"{name}.pid") for name in ("slurmd", "slurmctld", "munged")}
    pids |= {p.stem: _pid(p) for p in cluster.run_dir.glob("slurmd-*.pid")}  # one per node of a several-node cluster
    if _alive(pids["slurmctld"]):
        with contextlib.suppress(subprocess.TimeoutExpired):
            cluster.run("scancel", "-u", "root", timeout=20)
            deadline = time.monotonic() + timeout
            while cluster.jobs() and time.monotonic() < deadline:
                time.sleep(0.5)
    for name in sorted(pids, key=lambda n: (not n.startswith("slurmd"), n != "slurmctld")):
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

    ap = argparse.ArgumentParser(prog="python -m tests.support.slurm_cluster", description=__doc__.split("\n\n")[0])
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
