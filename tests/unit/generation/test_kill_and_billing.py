"""Nothing delivered is lost to a kill -9 beyond a bound that holds on any machine, nothing is
bought twice, and the bill is whole across the kills - checked against the server's own ledger.

The engine runs in a child process against a loopback OpenRouter server in this process; the
server's ledger records every request (billed or not, and whether its reply reached the socket
or its client was gone by then), so the project's figures are checked against an independent
record, never against a figure the client reads back. Bounds are counts and orders of events,
not times, so they hold on a slow or busy machine; the random moments are seeded: a failure
prints ``EAGLE3_KILL_SEED=...`` to replay it.
"""

import asyncio
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from eagle3_assets.corpus.inventory import response_frame, summarize
from eagle3_assets.engines.http.samples import SampleRequest, SamplingSettings
from eagle3_assets.engines.openrouter.backend import OpenRouterBackend
from eagle3_assets.generation.budget import TokenBudget
from eagle3_assets.generation.http_engine import RetryPolicy, run_generation
from eagle3_assets.generation.key_ledger import DEAD_RUN_REASON, KEY_LEDGER
from eagle3_assets.generation.response_store import ResponseStore
from eagle3_assets.loopback import FaultPlan, OpenRouterApp, SyntheticGenerator, messages_key

KEY = "sk-or-v1-kill-test-0123456789abcdef"
REPO = Path(__file__).resolve().parents[3]
# 16 attempts: with faults on a quarter of the requests, 8 left one sample of 400 unfinished (retries
# exhausted, as designed: 0.25**8 per sample) in 3 of about 250 runs; 16 make that 2e-10 per sample.
FAST = RetryPolicy(max_attempts=16, base_delay_s=0.01, max_delay_s=0.05, cooldown_s=0.05, seed=0)
WORKERS = 8  # the random-kill test's gate: what one kill can lose at most, one reply per worker
SETTLE_S = 120.0  # the longest wait for the server to finish what it had in flight (a deadline, not a bound)


@pytest.fixture
def seed():
    s = int(os.environ.get("EAGLE3_KILL_SEED") or random.SystemRandom().randrange(10**6))
    print(f"EAGLE3_KILL_SEED={s}")
    return s


def requests(n: int, dataset: str = "kill") -> list[SampleRequest]:
    return [SampleRequest(f"s{dataset}{i:06d}", dataset, f"p{i}", 0,
                          [{"role": "user", "content": f"{dataset}: question {i}"}]) for i in range(n)]


def child_main(spec_path: str) -> None:
    """The engine, in the child process that gets killed."""
    s = json.loads(Path(spec_path).read_text())
    backend = OpenRouterBackend(KEY, "moonshotai/kimi-k2.5", base_url=s["url"] + "/api/v1")
    asyncio.run(run_generation(requests(s["n"]), backend, ResponseStore(s["dir"]), TokenBudget(10**9),
                               sampling=SamplingSettings("t"), max_tokens=32, concurrency=s["concurrency"], retry=FAST))


def start_child(tmp_path, url, store_dir, n, concurrency) -> subprocess.Popen:
    spec = tmp_path / f"spec-{time.monotonic_ns()}.json"
    spec.write_text(json.dumps({"url": url, "dir": str(store_dir), "n": n, "concurrency": concurrency}))
    code = "import sys\nfrom tests.unit.generation.test_kill_and_billing import child_main\nchild_main(sys.argv[1])\n"
    return subprocess.Popen([sys.executable, "-c", code, str(spec)], cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def resume(reqs, srv, store, concurrency):
    return asyncio.run(run_generation(reqs, OpenRouterBackend(KEY, "m", base_url=srv.url + "/api/v1"), store,
                                      TokenBudget(10**9), sampling=SamplingSettings("t"), max_tokens=32,
                                      concurrency=concurrency, retry=FAST))


def settled(srv) -> dict:
    """The server's stats once every client connection is closed and nothing is in progress: what a
    killed client had sent (a request still in the socket when it died is read after the kill) is
    received, finished and billed."""
    deadline = time.monotonic() + SETTLE_S
    quiet_reads = 0  # two in a row, so a connection still in the listen queue at the first is accepted by the second
    while True:
        stats = srv.stats()
        quiet = stats["ledger"]["in_progress"] == 0 and stats["connections_open"] == 0
        quiet_reads = quiet_reads + 1 if quiet else 0
        if quiet_reads >= 2 or time.monotonic() > deadline:
            return stats
        time.sleep(0.1 if quiet else 0.02)


def the_bill(store: ResponseStore) -> dict:
    """What `eagle3 inventory` shows for the dataset (the `all` row), from the files."""
    return summarize("kill", response_frame(store.rows()), 10**9, store.billing(), 0).filter(source="all").to_dicts()[0]


def kept_generations(store: ResponseStore) -> set[str]:
    return {r["generation_id"] for r in store.rows()}


def test_kill_when_the_next_request_arrives_loses_nothing_delivered(tmp_path, serve, seed):
    """One worker: request k reaches the server only after reply k-1 was handled, so a kill at that
    moment must find every delivered reply in the file; the request in flight is billed when the
    server finishes it, and the next run finds that dollar figure and reports it."""
    app = OpenRouterApp(SyntheticGenerator(), api_key=KEY, latency_s=0.005, key_usage_start_usd=3.0)
    srv = serve(app)
    reqs = requests(60)
    by_sample = {r.sample_id: messages_key(r.messages) for r in reqs}
    store = ResponseStore(tmp_path / "r")
    k = random.Random(seed).randint(6, 40)
    killed = threading.Event()
    box = {}

    def on_request(n):
        if n == k and "proc" in box:
            box["t_kill"] = time.time()
            os.killpg(box["proc"].pid, signal.SIGKILL)
            killed.set()

    app.on_request = on_request
    box["proc"] = proc = start_child(tmp_path, srv.url, store.dir, len(reqs), concurrency=1)
    proc.wait(timeout=300)
    assert killed.is_set(), f"the child ended before request {k}: {proc.stderr.read()[-2000:]}"
    stats = settled(srv)
    ledger = stats["ledger_entries"]
    # later deliveries went to the socket of a process being torn down: they reach no one
    delivered = [e["key"] for e in ledger if e["billed"] and e["delivered_at"] is not None
                 and e["delivered_at"] < box["t_kill"]]
    kept = [by_sample[r["sample_id"]] for r in store.rows()]
    assert len(delivered) == k - 1 and sorted(kept) == sorted(delivered), (seed, k, len(delivered), len(kept))
    in_flight = ledger[k - 1]  # finished and billed after its client was killed, as a provider does
    assert in_flight["billed"] and in_flight["received_at"] >= box["t_kill"] - 1e-3, in_flight
    rep = resume(reqs, srv, store, concurrency=4)
    assert rep.already_done == k - 1 and rep.new == len(reqs) - (k - 1)
    # the dead run's bill: exactly the request it had in flight, reported by the run after it
    assert rep.billed_to_dead_runs_usd == pytest.approx(in_flight["cost_usd"], abs=1e-12)
    assert [d["gap_usd"] for d in rep.backend_info["dead_runs"]] == pytest.approx([in_flight["cost_usd"]], abs=1e-12)
    bill = the_bill(store)
    assert bill["billed_usd"] == pytest.approx(srv.stats()["ledger"]["billed_usd"], abs=1e-9)
    assert bill["billed_dead_runs_usd"] == pytest.approx(in_flight["cost_usd"], abs=1e-12)
    twice = {key for key, v in srv.stats()["generated"].items() if v > 1}
    assert twice.isdisjoint(delivered) and twice <= {in_flight["key"]}


def test_kill_at_random_points_counts_delivered_against_kept(tmp_path, serve, seed):
    """Eight workers, faults on, three kills at seeded random moments, then a clean finish: a kill
    loses at most one delivered reply per worker (received, not yet written), only lost or in-flight
    replies are bought again, and the project's bill equals the server's ledger."""
    faults = FaultPlan.from_strings("billed_drop=0.05,drop=0.05,429=0.05,502=0.05,finish_error=0.05", seed=seed,
                                    retry_after_s=0.01)
    app = OpenRouterApp(SyntheticGenerator(), api_key=KEY, latency_s=0.05, latency_jitter_s=0.1, faults=faults,
                        seed=seed, key_usage_start_usd=41.0)
    srv = serve(app)
    reqs = requests(400)
    by_sample = {r.sample_id: messages_key(r.messages) for r in reqs}
    store = ResponseStore(tmp_path / "r")
    rng = random.Random(seed)
    lost_per_kill: list[list[float]] = []  # ages (s) of the delivered replies not on disk, per kill
    on_disk_at_kills: list[tuple[set, dict]] = []  # rows on disk, replies generated per key
    windows: list[dict] = []  # per killed run: its window and the billing lines it wrote itself
    for round_ in range(3):
        before = len(store.rows())
        billing_before = len(store.billing())
        t_launch = time.time()
        proc = start_child(tmp_path, srv.url, store.dir, len(reqs), concurrency=WORKERS)
        deadline = time.monotonic() + 300
        target = before + rng.randint(15, 60)
        while len(store.rows()) < target and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(rng.uniform(0.005, 0.02))
        t_kill = time.time()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL, f"round {round_}: the child ended early: {proc.stderr.read()[-2000:]}"
        stats = settled(srv)
        t_settled = time.time()  # nothing arrives from the dead run after this, nothing from the next before
        starts = [json.loads(x) for x in (store.dir / KEY_LEDGER).read_text().splitlines()]
        own_billing = [b for b in store.billing()[billing_before:] if b["reason"] != DEAD_RUN_REASON]
        windows.append({"t_launch": t_launch, "t_end": t_settled, "billing": own_billing,
                        "run": [r for r in starts if r["event"] == "start"][-1]["run"]})
        delivered: dict[str, float] = {}
        for e in stats["ledger_entries"]:  # this run's billed replies the server handed to the socket before the kill
            if (e["received_at"] >= t_launch and e["billed"] and e["delivered_at"] is not None
                    and e["delivered_at"] < t_kill):
                delivered[e["key"]] = max(delivered.get(e["key"], 0.0), e["delivered_at"])
        kept = [by_sample[r["sample_id"]] for r in store.rows()]
        assert len(kept) == len(set(kept)), "a row was written twice"
        assert set(kept) <= {e["key"] for e in stats["ledger_entries"] if e["billed"] and e["delivered_at"] is not None}
        lost = [t_kill - t for key, t in delivered.items() if key not in set(kept)]
        assert len(lost) <= WORKERS, f"seed {seed}, round {round_}: {len(lost)} delivered replies lost, ages {sorted(lost)}"
        lost_per_kill.append(sorted(lost))
        on_disk_at_kills.append((set(kept), dict(stats["generated"])))
    rep = resume(reqs, srv, store, concurrency=WORKERS)
    kept_rows = store.rows()
    assert sorted(by_sample[r["sample_id"]] for r in kept_rows) == sorted(by_sample.values())
    assert rep.new + rep.already_done == len(reqs)
    stats = settled(srv)
    generated = stats["generated"]
    for kept_then, generated_then in on_disk_at_kills:  # a reply on disk at a kill is never bought again
        again = [k for k in kept_then if generated[k] > generated_then[k]]
        assert not again, f"seed {seed}: {len(again)} replies on disk were bought again"
    # bought again because of a kill (not a retry after a dropped reply): lost, or in flight when it
    # landed - one sample per worker per kill at most
    bought = {}
    for e in stats["ledger_entries"]:
        if e["billed"] and e["lost"] != "dropped":
            bought[e["key"]] = bought.get(e["key"], 0) + 1
    bought_twice = {k for k, n in bought.items() if n > 1}
    assert len(bought_twice) <= 3 * WORKERS, (seed, len(bought_twice))
    # the bill, against the server's ledger: each kept row is the generation the server delivered, at
    # its price; everything billed is in the project's bill, kills included
    billed = {e["generation_id"]: e for e in stats["ledger_entries"] if e["billed"]}
    assert kept_generations(store) <= {g for g, e in billed.items() if e["delivered_at"] is not None}
    assert math.fsum(r["cost_usd"] for r in kept_rows) == pytest.approx(
        math.fsum(billed[r["generation_id"]]["cost_usd"] for r in kept_rows), abs=1e-12)
    bill = the_bill(store)
    assert bill["billed_usd"] == pytest.approx(stats["ledger"]["billed_usd"], abs=1e-9), (seed, bill, stats["ledger"])
    reconciled = [json.loads(x) for x in (store.dir / KEY_LEDGER).read_text().splitlines()]
    reconciled = [r for r in reconciled if r["event"] == "reconciled"]
    assert len({r["run"] for r in reconciled}) == 3  # each killed run, found by the run after it
    dead = math.fsum(b["cost_usd"] for b in store.billing() if b["reason"] == DEAD_RUN_REASON)
    assert bill["billed_dead_runs_usd"] == pytest.approx(dead) and dead > 0
    # each killed run's bill, by the server's ledger: what arrived in its window, was billed, and was
    # kept nowhere (no row holds its generation, the run wrote no billing line for it) - against the
    # share the run after it reconciled for that run
    share = {r["run"]: r["share_usd"] for r in reconciled}
    for i, w in enumerate(windows):
        assert share.get(w["run"]) == pytest.approx(never_kept_usd(stats["ledger_entries"], w, kept_rows, by_sample),
                                                    abs=1e-9), (seed, i, share, w["run"])
    print(f"lost per kill: {[len(x) for x in lost_per_kill]} delivered replies (bound {WORKERS}, one per worker), "
          f"delivered {[round(1000 * a, 1) for x in lost_per_kill for a in x]} ms before the kill; bill: server "
          f"${stats['ledger']['billed_usd']:.6f}, project ${bill['billed_usd']:.6f} (to runs that died ${dead:.6f}: "
          f"{[round(share[w['run']], 6) for w in windows]} per killed run, each its window's billed-and-kept-nowhere; "
          f"{[len(w['billing']) for w in windows]} billing lines written by each)")


def never_kept_usd(entries: list[dict], window: dict, kept_rows: list[dict], by_sample: dict) -> float:
    """The server's bill for one killed run: requests that arrived between its launch and the moment
    its last connection closed (a request it sent just before the kill arrives after it), were billed,
    and were kept nowhere: not the generation of a row, and not a reply whose cost the run
    wrote to billing.jsonl itself (matched one for one, by conversation and cost, among its replies the
    server delivered)."""
    kept = {r["generation_id"] for r in kept_rows}
    ours = [e for e in entries if window["t_launch"] <= e["received_at"] <= window["t_end"] and e["billed"]
            and e["generation_id"] not in kept]
    for b in window["billing"]:  # a reply the run saw and billed without a row
        match = next((e for e in ours if e["key"] == by_sample[b["sample_id"]] and e["delivered_at"] is not None
                      and math.isclose(e["cost_usd"], b["cost_usd"], abs_tol=1e-12)), None)
        assert match is not None, f"billing line {b} matches no reply the server billed and delivered in the run"
        ours.remove(match)
    return math.fsum(e["cost_usd"] for e in ours)


def test_the_bill_includes_replies_lost_after_billing(tmp_path, serve):
    """Replies billed and then dropped on the way, retried and billed again: the run's dollars in
    each kind equal the server ledger's (kept = delivered and kept, unseen = billed, undelivered),
    whatever the key had spent before; billing.jsonl and the inventory keep them."""
    faults = FaultPlan.from_strings("billed_drop=0.15,429=0.05,finish_error=0.05", seed=3, retry_after_s=0.01)
    srv = serve(OpenRouterApp(SyntheticGenerator(), api_key=KEY, faults=faults, latency_s=0.01, key_usage_start_usd=17.25))
    reqs = requests(80, "bill")
    store = ResponseStore(tmp_path / "r")
    rep = resume(reqs, srv, store, concurrency=8)
    ledger = srv.stats()["ledger"]
    entries = {e["generation_id"]: e for e in srv.stats()["ledger_entries"] if e["billed"]}
    rows = store.rows()
    assert rep.new == 80 and ledger["billed_undelivered"] > 3 and rep.lost_attempts > 3
    kept = math.fsum(r["cost_usd"] for r in rows)
    assert kept == pytest.approx(math.fsum(entries[r["generation_id"]]["cost_usd"] for r in rows), abs=1e-12)
    assert rep.cost_usd == pytest.approx(kept, abs=1e-12)
    assert rep.billed_unseen_usd == pytest.approx(ledger["billed_undelivered_usd"], abs=1e-9)
    assert rep.billed_usd == pytest.approx(ledger["billed_usd"], abs=1e-9) and rep.billed_to_dead_runs_usd == 0
    assert any(b["reason"] == "unseen_by_client" for b in store.billing())
    inv = summarize("bill", response_frame(rows), 10**9, store.billing(), 0).filter(source="all").to_dicts()[0]
    assert inv["cost_usd"] == pytest.approx(kept, abs=1e-12)
    assert inv["billed_usd"] == pytest.approx(ledger["billed_usd"], abs=1e-9)


def test_the_loopback_bills_a_generation_whose_client_hung_up(serve):
    """As a provider bills a non-streaming request in flight: the client sends, then hangs up."""
    app = OpenRouterApp(SyntheticGenerator(), api_key=KEY, latency_s=0.2, key_usage_start_usd=1.0)
    srv = serve(app)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hung up"}], "max_tokens": 8}).encode()
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /api/v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
        while not srv.stats()["ledger"]["requests"]:
            time.sleep(0.005)
    stats = settled(srv)
    [entry] = stats["ledger_entries"]
    assert entry["billed"] and entry["lost"] == "client_gone" and entry["delivered_at"] is None
    assert stats["ledger"]["billed_undelivered_usd"] == entry["cost_usd"] > 0
