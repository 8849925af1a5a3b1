"""A real two-node SLURM on this machine: two network namespaces, each a host with its own address
and its own ``slurmd``, joined by a bridge to the controller (``slurmctld`` and ``munged`` here, in
the machine's own namespace). For the tests marked ``slurm`` that run a job across two nodes.

    python -m tests.support.slurm_two_nodes check   # start, srun -N2 hostname, stop (exit 1 on failure)

What makes it two hosts rather than two processes:

- each node's processes (its ``slurmd``, the job steps it starts, torchrun, the workers) see only
  their namespace's network: the loopback and one interface ``e3net`` with the node's address in a
  private /24 used by nothing else (the controller is ``.1``, the nodes ``.2`` and ``.3``);
- each node has its own host name, its node name (a UTS namespace), and its own ``/etc/hosts``
  (``/etc/netns/<ns>/hosts`` bound over it in a mount namespace of the node's own, as ``ip netns
  exec`` does, but keeping ``/sys`` and its cgroups, which ``slurmd`` needs): the node names
  resolve to their addresses, this machine's name to the controller's. So the rendezvous on "the
  first host of the node list", the address torchrun gives its workers and gloo's choice of
  interface work, or fail, as they would on two machines;
- a node can be lost on its own: :meth:`TwoNodeSlurm.kill_node` kills its ``slurmd`` and the
  steps in its namespace.

The file system is shared, as a cluster's is (the data root, the job folder, Pipes' files).
Everything is named with a random tag (namespaces, bridge, subnet, ``/etc/netns`` entries) and
removed by :func:`stop_two_nodes`, also after a failed start, so a leftover never blocks the next
run. Traffic stays between these namespaces and the controller's bridge address.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.slurm_cluster import (
    LocalSlurm,
    SlurmClusterError,
    missing_binaries,
    node_hardware,
    start_daemons,
    stop,
    wait_for_nodes,
    write_config,
)

IFACE = "e3net"  # the node's interface, the same name in each namespace
NETNS_ETC = Path("/etc/netns")


@dataclass
class TwoNodeSlurm:
    cluster: LocalSlurm
    tag: str
    subnet: str  # "10.213.<k>"
    nodes: list[str] = field(default_factory=list)  # node names, in order

    @property
    def conf(self) -> Path:
        return self.cluster.conf

    @property
    def bridge(self) -> str:
        return f"e3br{self.tag}"

    def namespace(self, i: int) -> str:
        return f"e3-{self.tag}-{i}"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 2}"

    def env(self) -> dict[str, str]:
        return self.cluster.env()

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return self.cluster.run(*args, timeout=timeout)

    def in_node(self, i: int, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """A command run on node ``i`` (its network, its hosts file)."""
        return subprocess.run(node_command(self.namespace(i), self.nodes[i], list(args)), capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, **self.env()})

    def slurmd_pid(self, i: int) -> int | None:
        try:
            return int((self.cluster.run_dir / f"slurmd-{self.nodes[i]}.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def kill_node(self, i: int) -> None:
        """Node ``i`` dies: its slurmd and every process in its namespace are killed at once.

        All are stopped (SIGSTOP) before any is killed, as a machine that loses power stops them all
        at the same instant: otherwise a process killed first could be seen dying by one not yet
        killed (a batch step's slurmstepd would report its job FAILED to the controller, where a lost
        node's jobs end NODE_FAIL). Listed again until no new process appears (one forked meanwhile)."""
        stopped: set[int] = set()
        while True:
            out = subprocess.run(["ip", "netns", "pids", self.namespace(i)], capture_output=True, text=True).stdout
            pids = ({int(p) for p in out.split()} | ({self.slurmd_pid(i)} - {None})) - stopped
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            stopped |= pids
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def restart_node(self, i: int, timeout: float = 90.0) -> None:
        """Node ``i`` back after :meth:`kill_node`: its slurmd started again, the node resumed."""
        cmd = node_command(self.namespace(i), self.nodes[i], ["slurmd", "-f", str(self.conf), "-N", self.nodes[i]])
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, **self.env()})
        if res.returncode != 0:
            raise SlurmClusterError(f"slurmd -N {self.nodes[i]} did not start again: {res.stderr.strip()}")
        self.run("scontrol", "update", f"nodename={self.nodes[i]}", "state=resume")
        wait_for_nodes(self.cluster, self.nodes, timeout)

    def logs(self, lines: int = 20) -> str:
        return self.cluster.logs(lines)


def node_command(ns: str, node: str, args: list[str]) -> list[str]:
    """``args`` on node ``node`` (namespace ``ns``): its network, its own host name (a UTS namespace)
    and its hosts file bound over ``/etc/hosts`` in a private mount namespace; nothing of the
    machine's own is changed."""
    hosts = NETNS_ETC / ns / "hosts"
    return ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c",
            f'mount --bind {hosts} /etc/hosts && hostname {node} && exec "$@"', "node", *args]


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise SlurmClusterError(f"`ip {' '.join(args)}` failed: {res.stderr.strip()}")


def _network(c: TwoNodeSlurm, host: str) -> None:
    """The bridge with the controller's address, a namespace per node wired to it, their hosts files."""
    _ip("link", "add", c.bridge, "type", "bridge")
    _ip("addr", "add", f"{c.subnet}.1/24", "dev", c.bridge)
    _ip("link", "set", c.bridge, "up")
    names = "\n".join(f"{c.address(i)} {n}" for i, n in enumerate(c.nodes))
    for i in range(len(c.nodes)):
        ns, outer = c.namespace(i), f"e3v{c.tag}{i}"
        _ip("netns", "add", ns)
        _ip("link", "add", outer, "type", "veth", "peer", "name", IFACE, "netns", ns)
        _ip("link", "set", outer, "master", c.bridge)
        _ip("link", "set", outer, "up")
        _ip("-n", ns, "addr", "add", f"{c.address(i)}/24", "dev", IFACE)
        _ip("-n", ns, "link", "set", IFACE, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        etc = NETNS_ETC / ns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n{c.subnet}.1 {host}\n{names}\n")


def _free_subnet() -> str:
    """A ``10.213.<k>`` /24 that no interface of this machine uses (a leftover bridge included)."""
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, timeout=30).stdout
    free = [k for k in range(2, 250) if f" 10.213.{k}." not in used]
    if not free:
        raise SlurmClusterError("step 'network namespaces': no free 10.213.<k>.0/24 subnet")
    return f"10.213.{random.choice(free)}"


def _remove_network(c: TwoNodeSlurm) -> None:
    for i in range(2):
        subprocess.run(["ip", "netns", "del", c.namespace(i)], capture_output=True, timeout=30)
        shutil.rmtree(NETNS_ETC / c.namespace(i), ignore_errors=True)
        subprocess.run(["ip", "link", "del", f"e3v{c.tag}{i}"], capture_output=True, timeout=30)
    subprocess.run(["ip", "link", "del", c.bridge], capture_output=True, timeout=30)
    with contextlib.suppress(OSError):
        NETNS_ETC.rmdir()  # only when no other namespace keeps files there


def start_two_nodes(root: Path, timeout: float = 90.0) -> TwoNodeSlurm:
    """Network, munged, slurmctld and one slurmd per namespace, until both nodes take jobs."""
    missing = missing_binaries() + ([] if shutil.which("ip") else ["ip (iproute2)"])
    if missing:
        raise SlurmClusterError(f"step 'binaries': not installed: {', '.join(missing)}")
    if os.geteuid() != 0:
        raise SlurmClusterError("step 'root': network namespaces and slurmd need root")
    root = Path(root).resolve()
    host, cpus, memory_mb = node_hardware()
    tag = f"{random.randrange(16**4):04x}"
    c = TwoNodeSlurm(None, tag, _free_subnet(), [f"e3n{tag}a", f"e3n{tag}b"])  # type: ignore[arg-type]
    try:
        _network(c, host)
    except SlurmClusterError as exc:
        _remove_network(c)
        raise SlurmClusterError(f"step 'network namespaces': {exc}") from None
    c.cluster = write_config(root, host, cpus, memory_mb, controller_addr=f"{c.subnet}.1",
                             nodes=[(n, c.address(i)) for i, n in enumerate(c.nodes)])
    for n in c.nodes:
        (root / f"spool-{n}").mkdir(exist_ok=True)
    slurmds = [node_command(c.namespace(i), n, ["slurmd", "-f", str(c.conf), "-N", n]) for i, n in enumerate(c.nodes)]
    try:
        start_daemons(c.cluster, slurmds)
        wait_for_nodes(c.cluster, c.nodes, timeout)
    except SlurmClusterError as exc:
        _remove_network(c)
        raise SlurmClusterError(f"step 'daemons': {exc}") from None
    return c


def stop_two_nodes(c: TwoNodeSlurm) -> None:
    """Cancel every job, stop the daemons, kill what is left in the namespaces, remove the network."""
    with contextlib.suppress(Exception):
        stop(c.cluster)
    for i in range(len(c.nodes)):
        c.kill_node(i)
    _remove_network(c)


@contextlib.contextmanager
def two_node_slurm(root: Path) -> Iterator[TwoNodeSlurm]:
    c = start_two_nodes(root)
    try:
        yield c
    finally:
        stop_two_nodes(c)


def check(root: Path) -> int:
    """Start, run one task on each node (each reports its own address), stop; 0 when it worked."""
    try:
        with two_node_slurm(root) as c:
            step = c.run("srun", "-N2", "--ntasks-per-node=1", "sh", "-c",
                         "echo $SLURMD_NODENAME $(hostname -i 2>/dev/null || true)", timeout=120)
            lines = sorted(step.stdout.strip().splitlines())
            want = sorted(f"{n} {c.address(i)}" for i, n in enumerate(c.nodes))
            if step.returncode != 0 or lines != want:
                print(f"srun -N2 gave {lines} (rc {step.returncode}), wanted {want}: {step.stderr.strip()}\n{c.logs()}",
                      file=sys.stderr)
                return 1
            print(f"two SLURM nodes work here: {', '.join(lines)}; controller {c.subnet}.1 on {socket.gethostname()}",
                  flush=True)
    except SlurmClusterError as exc:
        print(f"two SLURM nodes cannot start here: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tests.support.slurm_two_nodes",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("check",))
    ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="eagle3-slurm2-") as tmp:
        return check(Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
