"""The provider key's usage around every run, kept with each dataset's files: the bill across crashes.

A run reads the key's usage (OpenRouter ``GET /key``) before its first request and after its last.
A killed run never takes the second reading, yet the provider bills what it had in flight (a
non-streaming generation whose client vanished is finished and billed). So every run leaves, in
each of its datasets' directories:

* ``key_usage.jsonl`` (append-only): ``start`` (the reading before), ``end`` (the reading after,
  the run's own figures) and ``reconciled`` records;
* ``run_open-<run>.json`` while it runs (rewritten every second with its attempts and replies,
  removed at its end): a run that finds one left by a process that is gone knows that run died.

That run's spend is the key's growth from its start reading to the next reading any run took
after it, less every cost its replies showed (rows and ``billing.jsonl`` written after its start);
it is shared among its datasets by their attempts left without a reply, written to their
``billing.jsonl`` as ``billed_to_dead_run`` and reported. The key's usage counts every use of the
key: spend by another process on the same key in that window lands here too (``CAVEAT``).
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_assets.engines.http.wire import now_iso
from eagle3_assets.generation.response_store import JsonlAppender, ResponseStore, complete_length, iter_jsonl
from eagle3_assets.processes import alive

KEY_LEDGER = "key_usage.jsonl"
OPEN_RUN = "run_open-{run}.json"
DEAD_RUN_REASON = "billed_to_dead_run"
CAVEAT = ("from the key's usage between the run's start and the next reading of it: any other use of the same "
          "key in that window (another run, another tool) is counted too; run one generation per key at a time "
          "for an exact figure")


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, ensure_ascii=False))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _costs_after(path: Path, offset: int) -> float:
    """Dollars on the complete lines of a JSONL file past ``offset`` bytes."""
    if not path.exists():
        return 0.0
    end = complete_length(path)
    if end <= offset:
        return 0.0
    with path.open("rb") as fh:
        fh.seek(offset)
        data = fh.read(end - offset)
    total = []
    for raw in data.splitlines():
        try:
            total.append(float(json.loads(raw).get("cost_usd") or 0.0))
        except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
            continue
    return math.fsum(total)


@dataclass
class Reconciled:
    """One dead run's spend, as found by a later run."""

    run: str
    datasets: list[str]
    key_usage_before_usd: float
    next_reading_usd: float | None  # None when the key changed: not reconcilable
    seen_usd: float
    gap_usd: float  # what the provider billed beyond every cost the dead run saw (>= 0)
    shares: dict[str, float] = field(default_factory=dict)
    ended: bool = False  # the run ended but took no closing reading (not killed)

    def summary(self) -> dict:
        return {"run": self.run, "datasets": self.datasets, "gap_usd": self.gap_usd, "seen_usd": self.seen_usd,
                "key_usage_usd": [self.key_usage_before_usd, self.next_reading_usd], "shares_usd": self.shares,
                "how": "ended without a closing key reading" if self.ended else "died (killed or crashed)"}


class KeyLedger:
    """One run's records in its datasets' directories. ``stores`` maps dataset -> its store; every
    dataset of the data root lies beside them (``responses/<dataset>/``)."""

    def __init__(self, stores: dict[str, ResponseStore], source: str, key: str, run_id: str | None = None):
        self.stores, self.source, self.key = stores, source, key
        self.run = run_id or uuid.uuid4().hex[:12]
        self.responses_root = next(iter(stores.values())).dir.parent if stores else None
        self.usage_before: float | None = None
        self.started_at = 0.0
        self._last_state: dict[str, tuple] = {}

    # -- the start -----------------------------------------------------------------------------
    def open(self, usage_before: float) -> list[Reconciled]:
        """Reconcile the runs that died on these datasets, then record this run's start."""
        self.usage_before, self.started_at = usage_before, time.time()
        found = self._reconcile_dead(usage_before)
        for store in self.stores.values():
            start = {"event": "start", "run": self.run, "at": self.started_at, "created_at": now_iso(),
                     "key_usage_usd": usage_before, "key_id": self.key, "source": self.source,
                     "datasets": sorted(self.stores)}
            with JsonlAppender(store.dir / KEY_LEDGER) as out:
                out.append(start)
                out.sync()
            offsets = {name: complete_length(store.dir / name) if (store.dir / name).exists() else 0
                       for name in (f"{self.source}.jsonl", store.billing_path.name)}
            _write_json(store.dir / OPEN_RUN.format(run=self.run), {
                "run": self.run, "pid": os.getpid(), "host": socket.gethostname(), "started_at": self.started_at,
                "key_usage_before_usd": usage_before, "key_id": self.key, "source": self.source,
                "datasets": sorted(self.stores), "offsets": offsets, "attempts": 0, "answered": 0})
        return found

    def checkpoint(self, counters: dict[str, tuple[int, int]]) -> None:
        """Rewrite each dataset's open-run file with (attempts, answered) when they changed."""
        for ds, (attempts, answered) in counters.items():
            if self._last_state.get(ds) == (attempts, answered) or ds not in self.stores:
                continue
            path = self.stores[ds].dir / OPEN_RUN.format(run=self.run)
            state = _read_json(path)
            if state is None or state.get("run") != self.run:
                continue
            state.update(attempts=attempts, answered=answered, updated_at=time.time())
            _write_json(path, state)
            self._last_state[ds] = (attempts, answered)

    # -- the end -------------------------------------------------------------------------------
    def close(self, usage_after: float | None, figures: dict[str, dict]) -> None:
        """The closing reading: recorded per dataset with the run's own figures. Without one the
        open-run files stay (marked ended), and the next run reconciles this one."""
        for ds, store in self.stores.items():
            path = store.dir / OPEN_RUN.format(run=self.run)
            if usage_after is None:
                state = _read_json(path)
                if state is not None and state.get("run") == self.run:
                    _write_json(path, {**state, "ended": True})
                continue
            rec = {"event": "end", "run": self.run, "at": time.time(), "created_at": now_iso(),
                   "key_usage_usd": usage_after, "key_id": self.key,
                   "key_usage_delta_usd": usage_after - (self.usage_before or 0.0), **figures.get(ds, {})}
            with JsonlAppender(store.dir / KEY_LEDGER) as out:
                out.append(rec)
                out.sync()
            state = _read_json(path)
            if state is not None and state.get("run") == self.run:
                path.unlink(missing_ok=True)

    # -- runs that died ------------------------------------------------------------------------
    def _dataset_dir(self, dataset: str) -> Path:
        return self.stores[dataset].dir if dataset in self.stores else self.responses_root / dataset

    def _dead_runs(self) -> list[dict]:
        out, seen = [], set()
        host = socket.gethostname()
        for store in self.stores.values():
            for path in sorted(store.dir.glob(OPEN_RUN.format(run="*"))):
                state = _read_json(path)
                if state is None or state.get("run") in seen or state.get("run") == self.run:
                    continue
                pid = int(state.get("pid", 0))
                live = state.get("host") == host and pid != os.getpid() and alive(pid)
                if live and not state.get("ended"):
                    continue  # another live process runs this dataset: its bill is its own
                seen.add(state["run"])
                out.append(state)
        return out

    def _next_reading(self, after: float, key: str, default: float) -> float:
        """The first key reading (start or end of any run on this data root) after ``after``."""
        best_t, best = None, default
        for ledger in sorted(self.responses_root.glob(f"*/{KEY_LEDGER}")) if self.responses_root else []:
            for rec in iter_jsonl(ledger):
                t, usage = rec.get("at"), rec.get("key_usage_usd")
                if rec.get("key_id") != key or usage is None or t is None or t <= after:
                    continue
                if rec.get("event") in ("start", "end") and (best_t is None or t < best_t):
                    best_t, best = t, float(usage)
        return best

    def _reconcile_dead(self, usage_now: float) -> list[Reconciled]:
        found = []
        for state in self._dead_runs():
            datasets = sorted(state.get("datasets") or [])
            # one claimant per dead run: the open-run file of its first dataset is renamed by one run only
            name = OPEN_RUN.format(run=state["run"])
            first = self._dataset_dir(datasets[0]) / name
            claimed = first.with_name(f".{name}.reconciling-{self.run}")
            try:
                os.rename(first, claimed)
            except FileNotFoundError:
                continue
            states = {}
            for ds in datasets:
                path = claimed if ds == datasets[0] else self._dataset_dir(ds) / name
                st = _read_json(path)
                if st is not None and st.get("run") == state["run"]:
                    states[ds] = (path, st)
            seen = math.fsum(
                _costs_after(self._dataset_dir(ds) / name, off)
                for ds, (_, st) in states.items() for name, off in (st.get("offsets") or {}).items())
            before = float(state["key_usage_before_usd"])
            same_key = state.get("key_id") == self.key
            nxt = self._next_reading(float(state["started_at"]), self.key, usage_now) if same_key else None
            gap = max(0.0, nxt - before - seen) if nxt is not None else 0.0
            rec = Reconciled(state["run"], datasets, before, nxt, seen, gap, ended=bool(state.get("ended")))
            weights = {ds: max(0, int(st.get("attempts", 0)) - int(st.get("answered", 0))) for ds, (_, st) in states.items()}
            if not sum(weights.values()):
                weights = {ds: int(st.get("attempts", 0)) for ds, (_, st) in states.items()}
            if not sum(weights.values()):
                weights = {ds: 1 for ds in states}
            total = sum(weights.values()) or 1
            for ds, (path, _) in states.items():
                share = gap * weights[ds] / total
                rec.shares[ds] = share
                d = self._dataset_dir(ds)
                note = {"run": state["run"], "reconciled_by": self.run, "key_usage_usd": [before, nxt],
                        "dead_run_seen_usd": seen, "dead_run_gap_usd": gap, "caveat": CAVEAT}
                if not same_key:
                    note["caveat"] = "the key changed since that run: its in-flight spend cannot be read from key usage"
                if share > 0:
                    with JsonlAppender(d / "billing.jsonl") as out:
                        out.append({"sample_id": None, "source": state.get("source"), "cost_usd": share,
                                    "reason": DEAD_RUN_REASON, "created_at": now_iso(), **note})
                        out.sync()
                with JsonlAppender(d / KEY_LEDGER) as out:
                    out.append({"event": "reconciled", "at": time.time(), "created_at": now_iso(), "share_usd": share,
                                "attempts_without_reply": weights[ds], "key_id": self.key, **note})
                    out.sync()
                path.unlink(missing_ok=True)
            found.append(rec)
        return found
