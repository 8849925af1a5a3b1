"""The spool directory: published units, leases, the consumed cursor and the byte budget.

Layout under ``spool_dir``: ``plan.json``; ``units/<unit>/`` (a published unit: a hidden-state
directory as ``extract_corpus`` writes it, moved into place by one rename); ``tmp/<unit>-<pid>/``
(a unit being captured); ``leases/<unit>.json`` (created with O_EXCL: pid, host, process start
time, reserved bytes; its mtime is the heartbeat); ``cursor.json`` (positions the trainer has
consumed, written atomically by rank 0 after each optimizer step); ``done.json`` (the run ended);
``failed.json`` (the run cannot go on: a producer found the disk full, or every producer ended
and none is started again; the trainer stops at once with its message).

Every decision that reads and changes the budget (take a unit, publish one, move the cursor,
delete consumed units) runs under one ``flock`` on ``.lock``, so two producers cannot both fit
into the last free bytes and a unit consumed while it was captured is dropped, not published.
A kill -9 releases the lock (the kernel drops it with the process).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

from eagle3_assets.files import write_text_atomic
from eagle3_assets.hidden_states.journal import now_iso

CURSOR, DONE, FAILED, LOCK = "cursor.json", "done.json", "failed.json", ".lock"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (tells a reused pid apart), or None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    if fields[0] in ("Z", "X"):  # a zombie: killed, not yet reaped
        return None
    return fields[19]


def write_json_atomic(path: Path, data: dict) -> None:
    write_text_atomic(path, json.dumps(data))


def tree_bytes(path: Path) -> int:
    """Bytes of every file under ``path`` (sizes as ``stat`` gives them), 0 when it is gone.

    Each file counts once by its inode: a unit renamed (published, or moved out to be deleted) while
    the walk runs is met twice, once under each name, and would otherwise be counted twice."""
    total, seen = 0, set()
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(root, f))
            except OSError:
                continue  # removed while walking
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


class Spool:
    """One spool directory, shared by the producers and every trainer rank."""

    def __init__(self, root: Path | str, *, stale_s: float = 60.0):
        self.root = Path(root)
        self.units_dir, self.tmp_dir, self.leases_dir = self.root / "units", self.root / "tmp", self.root / "leases"
        for d in (self.units_dir, self.tmp_dir, self.leases_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.host = socket.gethostname()
        self.stale_s = stale_s

    # -- the lock and the cursor ----------------------------------------------------------

    @contextlib.contextmanager
    def lock(self):
        fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def cursor(self) -> int:
        """Positions consumed: every position below it was trained by a finished optimizer step."""
        path = self.root / CURSOR
        return int(json.loads(path.read_text())["position"]) if path.exists() else 0

    def write_cursor(self, position: int, step: int | None = None) -> None:
        write_json_atomic(self.root / CURSOR, {"position": int(position), "step": step, "at": now_iso()})

    def done(self) -> dict | None:
        path = self.root / DONE
        return json.loads(path.read_text()) if path.exists() else None

    def mark_done(self, info: dict) -> None:
        write_json_atomic(self.root / DONE, {**info, "at": now_iso()})

    def failed(self) -> dict | None:
        """Why the run cannot go on (``failed.json``), or None."""
        try:
            return json.loads((self.root / FAILED).read_text())
        except (OSError, ValueError):
            return None

    def mark_failed(self, who: str, error: str) -> None:
        """Record that the run cannot go on: the trainer stops at once, naming ``who`` and ``error``.
        Best effort: on a disk too full even for this small file the producer's exit still tells the step."""
        with contextlib.suppress(OSError):
            write_json_atomic(self.root / FAILED, {"by": who, "host": self.host, "pid": os.getpid(), "error": error,
                                                   "at": now_iso()})

    def clear_failed(self) -> None:
        """A new attempt starts (the step, or the trainer before it writes the plan): an earlier failure is history."""
        (self.root / FAILED).unlink(missing_ok=True)

    # -- units ----------------------------------------------------------------------------

    def published(self) -> set[str]:
        return {p.name for p in self.units_dir.iterdir() if p.is_dir()}

    def unit_dir(self, uid: str) -> Path:
        return self.units_dir / uid

    def bytes_on_disk(self, *, with_tmp: bool = True) -> int:
        """The spool's bytes as the filesystem has them (temporary folders included unless told)."""
        total = tree_bytes(self.root)
        return total - (0 if with_tmp else tree_bytes(self.tmp_dir))

    def sweep(self, plan, cursor: int | None = None) -> list[str]:
        """Delete every published unit whose last use is below the cursor (call under the lock)."""
        cursor = self.cursor() if cursor is None else cursor
        gone = []
        for uid in sorted(self.published()):
            unit = plan.by_id.get(uid)
            if unit is None or unit.last_use < cursor:
                self.remove_unit(uid)
                gone.append(uid)
        return gone

    def remove_unit(self, uid: str) -> None:
        """Out of the namespace first (one rename), then the files: a reader never sees half a unit."""
        src = self.unit_dir(uid)
        trash = self.tmp_dir / f".gone-{uid}-{os.getpid()}"
        try:
            os.replace(src, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    # -- leases ---------------------------------------------------------------------------

    def leases(self) -> dict[str, dict]:
        out = {}
        for p in self.leases_dir.glob("*.json"):
            try:
                data = json.loads(p.read_text() or "{}")
                mtime = p.stat().st_mtime
            except (OSError, ValueError):
                data, mtime = {}, time.time()
            out[p.stem] = {**data, "mtime": mtime, "path": str(p)}
        return out

    def alive(self, lease: dict) -> bool:
        """A lease's producer runs: on this host its pid (with the same start time), elsewhere a fresh heartbeat."""
        fresh = time.time() - lease["mtime"] < self.stale_s
        if "pid" not in lease:  # being written: alive while young
            return fresh
        if lease.get("host") == self.host:
            return _start_time(int(lease["pid"])) == lease.get("start") and fresh
        return fresh

    def reclaim(self) -> list[str]:
        """Give the units of dead producers back to the pool: their temporary folders go, then the lease
        (call under the lock). Also removes temporary folders no live lease owns."""
        back = []
        live_tmp = set()
        for uid, lease in self.leases().items():
            if self.alive(lease):
                live_tmp.add(lease.get("tmp"))
                continue
            if lease.get("tmp"):
                shutil.rmtree(self.tmp_dir / lease["tmp"], ignore_errors=True)
            Path(lease["path"]).unlink(missing_ok=True)
            back.append(uid)
        for p in self.tmp_dir.iterdir():
            if p.name not in live_tmp:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        return back

    def reserved(self) -> int:
        """Bytes the live leases hold back (each unit's bound, whatever its folder holds so far)."""
        return sum(int(lease.get("bytes", 0)) for lease in self.leases().values() if self.alive(lease))

    def used(self) -> int:
        """What the cap is checked against: the spool's files outside ``tmp/`` plus the live reservations."""
        return self.bytes_on_disk(with_tmp=False) + self.reserved()

    def take(self, uid: str, nbytes: int, producer: str) -> dict | None:
        """Lease ``uid`` (O_EXCL); None when another process holds it."""
        path = self.leases_dir / f"{uid}.json"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return None
        pid = os.getpid()
        lease = {"unit": uid, "pid": pid, "host": self.host, "start": _start_time(pid), "bytes": int(nbytes),
                 "producer": producer, "tmp": f"{uid}-{pid}", "at": now_iso()}
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(lease))
            fh.flush()
            os.fsync(fh.fileno())
        (self.tmp_dir / lease["tmp"]).mkdir(parents=True, exist_ok=True)
        return {**lease, "path": str(path)}

    def drop(self, lease: dict) -> None:
        Path(lease["path"]).unlink(missing_ok=True)

    def owns(self, lease: dict) -> bool:
        try:
            data = json.loads(Path(lease["path"]).read_text())
        except (OSError, ValueError):
            return False
        return data.get("pid") == lease["pid"] and data.get("host") == lease["host"]


def unit_problem(directory: Path) -> str | None:
    """What is wrong with a published unit's files against its own manifest (every shard there, of its
    recorded size and sha256), or None: a unit is read back against its digest before it is trained on."""
    from eagle3_assets.hidden_states.encoding import sha256_file
    from eagle3_assets.hidden_states.shards import MANIFEST

    try:
        manifest = json.loads((Path(directory) / MANIFEST).read_text())
        shards = manifest["shards"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its manifest cannot be read ({exc})"
    for entry in shards:
        path = Path(directory) / entry["file"]
        size = path.stat().st_size if path.exists() else None
        if size != entry["bytes"]:
            return f"{entry['file']}: {'missing' if size is None else f'{size:,} bytes'}, the manifest says {entry['bytes']:,}"
        if sha256_file(path) != entry["sha256"]:
            return f"{entry['file']}: sha256 differs from the manifest's"
    return None


class Heartbeat:
    """Touches the leases this process holds every ``every_s`` seconds (their mtime is the heartbeat)."""

    def __init__(self, every_s: float = 2.0):
        self.paths: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True, name="spool-heartbeat")
        self._thread.start()

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            for p in list(self.paths):
                with contextlib.suppress(OSError):
                    os.utime(p)

    def stop(self) -> None:
        self._stop.set()
