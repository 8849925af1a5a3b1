"""The key-usage ledger on its own: runs that die, the next reading, shares, one claimant, keys.

Dollars here are written by the test (the provider's readings and the rows a run wrote), so every
expected figure is the test's own arithmetic, not the code's.
"""

import json
import subprocess
import sys

import pytest

from eagle3_assets.corpus.inventory import response_frame, summarize, write_inventory
from eagle3_assets.corpus.report import print_inventory
from eagle3_assets.engines.http.wire import key_id
from eagle3_assets.generation.key_ledger import DEAD_RUN_REASON, KEY_LEDGER, OPEN_RUN, KeyLedger
from eagle3_assets.generation.response_store import JsonlAppender, ResponseStore
from eagle3_assets.paths import DataLayout

KEY = key_id("sk-or-v1-ledger-test")


def stores(tmp_path, *names) -> dict[str, ResponseStore]:
    out = {}
    for n in names:
        out[n] = ResponseStore(tmp_path / "responses" / n)
        out[n].dir.mkdir(parents=True, exist_ok=True)
    return out


def write_rows(store: ResponseStore, costs: list[float], source: str = "openrouter") -> None:
    with JsonlAppender(store.path(source)) as out:
        for i, c in enumerate(costs):
            out.append({"sample_id": f"s{store.dir.name}{i}-{c}", "source": source, "cost_usd": c,
                        "completion_tokens": 1, "finish_reason": "stop"})


def die(ledger: KeyLedger, pid: int) -> None:
    """What a killed process leaves: its open-run files, naming a process that is gone."""
    for store in ledger.stores.values():
        path = store.dir / OPEN_RUN.format(run=ledger.run)
        state = json.loads(path.read_text())
        path.write_text(json.dumps({**state, "pid": pid}))


def open_runs(store: ResponseStore) -> list[str]:
    return sorted(json.loads(p.read_text())["run"] for p in store.dir.glob(OPEN_RUN.format(run="*")))


@pytest.fixture(scope="module")
def gone_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_dead_run_is_reconciled_once_and_shared_by_attempts_without_reply(tmp_path, gone_pid, capsys):
    s = stores(tmp_path, "a", "b")
    dead = KeyLedger(s, "openrouter", KEY)
    dead.open(10.0)
    write_rows(s["a"], [0.25, 0.25])  # what its replies showed: $0.75
    write_rows(s["b"], [0.25])
    dead.checkpoint({"a": (10, 7), "b": (10, 9)})  # 3 and 1 attempts without a reply
    die(dead, gone_pid)
    # the provider's reading at the next start: $0.75 seen + $2.00 billed for what was in flight
    nxt = KeyLedger(s, "openrouter", KEY)
    found = nxt.open(12.75)
    assert len(found) == 1 and found[0].run == dead.run
    assert found[0].gap_usd == pytest.approx(2.0) and found[0].seen_usd == pytest.approx(0.75)
    assert found[0].shares == pytest.approx({"a": 1.5, "b": 0.5})
    for ds, share in (("a", 1.5), ("b", 0.5)):
        bills = [b for b in s[ds].billing() if b["reason"] == DEAD_RUN_REASON]
        assert [b["run"] for b in bills] == [dead.run] and bills[0]["cost_usd"] == pytest.approx(share)
        assert "any other use of the same key" in bills[0]["caveat"]
        events = [json.loads(x)["event"] for x in (s[ds].dir / KEY_LEDGER).read_text().splitlines()]
        assert events == ["start", "reconciled", "start"]
        assert open_runs(s[ds]) == [nxt.run]  # only the live run's file is left
    # the inventory shows the share as billed, and as billed to runs that died
    inv = summarize("a", response_frame(s["a"].rows()), 10**9, s["a"].billing(), 0).filter(source="all").to_dicts()[0]
    assert inv["billed_usd"] == pytest.approx(0.5 + 1.5) and inv["billed_dead_runs_usd"] == pytest.approx(1.5)
    layout = DataLayout(tmp_path)  # and `eagle3 inventory` says what that figure is
    write_inventory(layout.metadata_db, "a", summarize("a", response_frame(s["a"].rows()), 10**9, s["a"].billing(), 0))
    print_inventory(layout)
    shown = " ".join(capsys.readouterr().out.split())
    assert "1.5" in shown and "any other use of the same key" in shown
    nxt.close(13.0, {})
    assert open_runs(s["a"]) == open_runs(s["b"]) == []
    assert KeyLedger(s, "openrouter", KEY).open(13.0) == []  # nothing left to reconcile


def test_two_runs_find_the_same_dead_run_and_only_one_reconciles_it(tmp_path, gone_pid):
    s = stores(tmp_path, "a", "b")
    dead = KeyLedger(s, "openrouter", KEY)
    dead.open(1.0)
    die(dead, gone_pid)
    first = KeyLedger({"b": s["b"]}, "openrouter", KEY).open(2.0)  # it finds the dead run through b
    second = KeyLedger({"a": s["a"]}, "openrouter", KEY).open(2.0)
    assert [r.run for r in first] == [dead.run] and second == []
    assert sum(r["cost_usd"] for st in s.values() for r in st.billing()) == pytest.approx(1.0)


def test_the_next_reading_may_be_another_runs_and_a_closed_run_leaves_nothing(tmp_path, gone_pid):
    s = stores(tmp_path, "a", "other")
    dead = KeyLedger({"a": s["a"]}, "openrouter", KEY)
    dead.open(5.0)
    die(dead, gone_pid)
    # another dataset's run takes the next reading ($5.40: the dead run's in-flight spend), spends $1
    other = KeyLedger({"other": s["other"]}, "openrouter", KEY)
    assert other.open(5.40) == []  # not its dataset
    other.close(6.40, {"other": {"run_seen_usd": 1.0}})
    assert open_runs(s["other"]) == []
    found = KeyLedger({"a": s["a"]}, "openrouter", KEY).open(6.40)
    assert len(found) == 1 and found[0].gap_usd == pytest.approx(0.40)  # not the other run's $1


def test_a_live_run_is_left_alone_and_a_changed_key_is_not_reconciled(tmp_path, gone_pid):
    s = stores(tmp_path, "a")
    live = KeyLedger(s, "openrouter", KEY)
    live.open(1.0)
    probe = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        die(live, probe.pid)  # its process is still there: another live run of this dataset
        beside = KeyLedger(s, "openrouter", KEY)
        assert beside.open(2.0) == [] and open_runs(s["a"]) == sorted([live.run, beside.run])
        beside.close(2.5, {})
    finally:
        probe.kill()
        probe.wait()
    die(live, gone_pid)
    found = KeyLedger(s, "openrouter", key_id("sk-or-v1-another-key")).open(0.5)
    assert len(found) == 1 and found[0].next_reading_usd is None and found[0].gap_usd == 0.0
    assert not [b for b in s["a"].billing() if b["reason"] == DEAD_RUN_REASON]


def test_a_run_without_a_closing_reading_is_reconciled_by_the_next(tmp_path):
    s = stores(tmp_path, "a")
    run = KeyLedger(s, "openrouter", KEY)
    run.open(3.0)
    write_rows(s["a"], [0.5])
    run.close(None, {})  # GET /key failed at the end: the open-run file stays, marked ended
    found = KeyLedger(s, "openrouter", KEY).open(3.75)
    assert len(found) == 1 and found[0].ended and found[0].gap_usd == pytest.approx(0.25)
