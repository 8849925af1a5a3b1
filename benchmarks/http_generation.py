"""Benchmark: the HTTP generation engine at 2,000 in flight against the loopback server.

The server runs in its own process (``python -m eagle3_assets.loopback openrouter --synthetic``:
fake ids, a simulated latency per request), so the figures below are the *client's* costs:

* achieved concurrency: mean requests in flight over the gate while samples were waiting
  (client side: sent and not yet answered *as seen by the client*), and the server's own
  time-weighted count of requests it was holding, over the steady window (40%..100% of the
  variant's time limit). The two differ when the client cannot keep up: Little's law caps the
  server-side figure at requests/s x latency, so at 1.5-2 s a full 2,000 gate needs ~1,100
  requests/s from one Python process; the last variant uses a longer latency (8-10 s, still far
  below a real ~165 s Kimi generation) where ~220 requests/s suffice;
* requests/s, client CPU seconds per request (``resource.getrusage`` of the client process) and
  its peak RSS (``ru_maxrss``); each variant runs in a fresh client process;
* side by side: sharded clients (one AsyncClient per ~10 connections, the engine's design)
  versus a single AsyncClient whose pool holds every connection. Each variant is bounded by a
  request count and a wall-clock limit (then the stop event drains it), and its process is
  killed at a hard deadline if it cannot stop (then the rows it had written are counted), so
  every variant ends within a minute and the whole run in about two and a half.

    .venv/bin/python benchmarks/http_generation.py                  # ~2.5 minutes
    .venv/bin/python benchmarks/http_generation.py --quick          # ~1 minute smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from results import record

try:
    import psutil  # only for the server process's CPU time
except ImportError:  # pragma: no cover
    psutil = None
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_assets.engines.http.samples import SampleRequest, SamplingSettings  # noqa: E402
from eagle3_assets.engines.openrouter.backend import OpenRouterBackend  # noqa: E402
from eagle3_assets.generation.budget import TokenBudget  # noqa: E402
from eagle3_assets.generation.http_engine import ClientConfig, RetryPolicy, run_generation  # noqa: E402
from eagle3_assets.generation.response_store import ResponseStore  # noqa: E402

KEY = "sk-bench-loopback"


def start_server(latency: float, jitter: float) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "eagle3_assets.loopback", "openrouter", "--synthetic", "--port", "0",
           "--latency", str(latency), "--latency-jitter", str(jitter), "--api-key", KEY, "--uvloop"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        proc.kill()
        raise RuntimeError(f"server did not start: {line}{proc.stdout.read()}")
    return proc, line.split()[2]


def requests_for(n: int, tag: str) -> list[SampleRequest]:
    return [SampleRequest(f"s{tag}{i:08x}", "bench", f"p{i}", 0,
                          [{"role": "user", "content": f"benchmark prompt {tag} {i}"}]) for i in range(n)]


async def run_variant(name: str, url: str, *, concurrency: int, n: int, time_limit: float, single: bool,
                      store_dir: str, connections: int = 10, **_) -> dict:
    """One variant, in this (child) process: the figures are this process's own."""
    store = ResponseStore(store_dir)
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(time_limit, stop.set)
    lags: list[float] = []

    async def lag_sampler():  # how late the event loop wakes a 50 ms sleep: > 0 means it is saturated
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.05)
            lags.append(time.monotonic() - t - 0.05)

    sampler = asyncio.create_task(lag_sampler())
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.monotonic()
    report = await run_generation(
        requests_for(n, name[:2]), OpenRouterBackend(KEY, "bench/synthetic", base_url=url + "/api/v1"), store,
        TokenBudget(10**12), sampling=SamplingSettings("bench"), max_tokens=16, concurrency=concurrency,
        stop_event=stop, retry=RetryPolicy(max_attempts=3, base_delay_s=0.5),
        client=ClientConfig(single_client=single, connections_per_client=connections, read_timeout_s=120,
                            attempt_timeout_s=300),
        drain_timeout_s=5.0, preflight=False)
    wall = time.monotonic() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    sampler.cancel()
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    return {
        "variant": name, "gate": concurrency, "clients": report.clients, "rows": report.new,
        "attempts": report.attempts, "wall_s": wall, "req_s": report.new / wall if wall else 0.0,
        "client_in_flight_mean": report.in_flight_mean, "achieved": report.achieved_concurrency,
        "cpu_s": cpu, "cpu_ms_per_req": 1000 * cpu / max(1, report.attempts),
        "peak_rss_mb": ru1.ru_maxrss / 1024, "stopped": report.stopped_reason or "finished",
        "errors": report.errors, "retries": sum(report.retries.values()),
        "loop_lag_ms_mean": 1000 * sum(lags) / max(1, len(lags)), "loop_lag_ms_max": 1000 * max(lags, default=0.0),
    }


def server_stats(url: str, reset: bool = False, config: dict | None = None) -> dict:
    with httpx.Client(timeout=30) as c:
        if config:
            c.post(url + "/_loopback/config", json=config)
        if reset:
            c.get(url + "/_loopback/reset")
        return c.get(url + "/_loopback/stats").json()


def run_child(url: str, spec: dict, server_pid: int) -> dict:
    """Run one variant in a fresh process, killed at a hard deadline if it cannot stop by itself."""
    server_stats(url, reset=True, config={"latency_s": spec["latency"], "latency_jitter_s": spec["jitter"]})
    hard = spec["time_limit"] + 5.0 + spec.get("grace", 20.0)
    store_dir = tempfile.mkdtemp(prefix="bench-http-")
    server_cpu0 = sum(psutil.Process(server_pid).cpu_times()[:4]) if psutil else None
    proc = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(dict(spec, url=url, store_dir=store_dir))],
                            stdout=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    # the server's time-weighted concurrency over the steady window [40% of the limit, the limit]
    marks = []
    for at in (0.4 * spec["time_limit"], spec["time_limit"] - 0.2):
        time.sleep(max(0.0, at - (time.monotonic() - t0)))
        if proc.poll() is None:
            marks.append(server_stats(url))
    steady = ((marks[1]["concurrency_area"] - marks[0]["concurrency_area"]) / (marks[1]["time"] - marks[0]["time"])
              if len(marks) == 2 else float("nan"))
    try:
        out, _ = proc.communicate(timeout=max(1.0, hard - (time.monotonic() - t0)))
        result = json.loads(out.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        result = None
    wall = time.monotonic() - t0
    st = server_stats(url)
    if result is None:  # the rows the killed client had written, and the server's counts
        rows = ResponseStore(store_dir).path("openrouter").read_bytes().count(b"\n") \
            if ResponseStore(store_dir).path("openrouter").exists() else 0
        result = {"variant": spec["name"], "gate": spec["concurrency"],
                  "clients": 1 if spec["single"] else -(-spec["concurrency"] // spec.get("connections", 10)),
                  "rows": rows, "attempts": st["requests"], "wall_s": wall, "req_s": rows / wall,
                  "client_in_flight_mean": float("nan"), "achieved": float("nan"), "cpu_s": float("nan"),
                  "cpu_ms_per_req": float("nan"), "peak_rss_mb": float("nan"),
                  "stopped": f"KILLED at the {hard:.0f}s hard limit (rows = lines it had written)", "errors": 0,
                  "retries": 0, "loop_lag_ms_mean": float("nan"), "loop_lag_ms_max": float("nan")}
    shutil.rmtree(store_dir, ignore_errors=True)
    result["server_concurrency_mean"] = st["concurrency_mean"]
    result["server_concurrency_steady"] = steady
    result["server_concurrency_peak"] = st["concurrency_peak"]
    result["server_replies"] = st["billed_replies"]
    result["latency"] = spec["latency"] + spec["jitter"] / 2
    result["server_cpu_ms_per_req"] = (1000 * (sum(psutil.Process(server_pid).cpu_times()[:4]) - server_cpu0)
                                       / max(1, st["requests"])) if psutil else float("nan")
    return result


def fmt(r: dict) -> str:
    return (f"{r['variant']:<24} {r['rows']:>6} rows {r['req_s']:>6.1f} req/s | in flight: client "
            f"{r['client_in_flight_mean']:>6.1f} = {100 * r['achieved']:5.1f}% of {r['gate']}, at the server "
            f"{r['server_concurrency_steady']:>6.1f} steady ({100 * r['server_concurrency_steady'] / r['gate']:5.1f}%) "
            f"peak {r['server_concurrency_peak']} | client CPU {r['cpu_ms_per_req']:.2f} ms/req (server "
            f"{r['server_cpu_ms_per_req']:.2f}), loop lag {r['loop_lag_ms_mean']:.0f} ms mean | peak RSS "
            f"{r['peak_rss_mb']:.0f} MiB | {r['clients']} client(s) | {r['stopped']}, {r['wall_s']:.1f}s")


def main(args) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 8192:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 16384), hard))
    proc, url = start_server(args.latency, args.jitter)
    try:
        print(f"loopback OpenRouter server in its own process (SYNTHETIC ids), simulated latency "
              f"{args.latency}s + uniform(0, {args.jitter})s; each variant in a fresh client process; "
              f"python {sys.version.split()[0]}, httpx {httpx.__version__}, {os.cpu_count()} CPUs, "
              f"load average {os.getloadavg()[0]:.2f} before the run", flush=True)
        lat = dict(latency=args.latency, jitter=args.jitter)
        variants = [
            dict(name="sharded x10 @2000", concurrency=2000, n=args.n, time_limit=args.limit, single=False, **lat),
            dict(name="single-client @2000", concurrency=2000, n=args.n, time_limit=args.single_limit, single=True,
                 grace=10.0, **lat),
            dict(name="sharded x10 @200", concurrency=200, n=args.n_small, time_limit=args.small_limit, single=False,
                 **lat),
            dict(name="single-client @200", concurrency=200, n=args.n_small, time_limit=args.small_limit, single=True,
                 grace=10.0, **lat),
            dict(name=f"sharded x10 @2000 {args.long_latency:g}s", concurrency=2000, n=args.n, time_limit=args.long_limit,
                 single=False, latency=args.long_latency, jitter=args.long_latency / 4),
        ]
        results = []
        for spec in variants:
            r = run_child(url, spec, proc.pid)
            results.append(r)
            print(fmt(r), flush=True)
        by = {r["variant"]: r for r in results}
        for gate in (2000, 200):
            s, o = by[f"sharded x10 @{gate}"], by[f"single-client @{gate}"]
            ratio = s["req_s"] / o["req_s"] if o["req_s"] else float("inf")
            print(f"@{gate} in flight: sharded clients {s['req_s']:.1f} req/s vs one client {o['req_s']:.1f} req/s "
                  f"({ratio:.1f}x)")
        for r in (results[0], results[-1]):
            ok = "PASS" if r["achieved"] >= 0.95 else "BELOW TARGET"
            srv = r["server_concurrency_steady"] / r["gate"]
            print(f"{r['variant']}: in flight {100 * r['achieved']:.1f}% of the gate, client side ({ok}, target >= 95%); "
                  f"held at the server {100 * srv:.1f}% in steady state ({'PASS' if srv >= 0.95 else 'BELOW TARGET'}); "
                  f"a full gate at {r['latency']:.2f}s mean latency needs {r['gate'] / r['latency']:.0f} req/s, "
                  f"the client did {r['req_s']:.0f} req/s over the whole run")
        print(f"load average {os.getloadavg()[0]:.2f} after the run (other processes share these CPUs)")
        record("http_generation", {"variants": by})
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--latency", type=float, default=1.5)
    p.add_argument("--jitter", type=float, default=0.5)
    p.add_argument("--n", type=int, default=12000, help="requests for the sharded @2000 variant")
    p.add_argument("--limit", type=float, default=25.0, help="seconds for the sharded @2000 variant")
    p.add_argument("--single-limit", type=float, default=20.0, help="seconds for the single-client @2000 variant")
    p.add_argument("--long-latency", type=float, default=8.0, help="latency of the last variant (closer to real)")
    p.add_argument("--n-small", type=int, default=4000)
    p.add_argument("--small-limit", type=float, default=10.0)
    p.add_argument("--long-limit", type=float, default=40.0, help="seconds for the long-latency variant")
    p.add_argument("--quick", action="store_true", help="short limits for a smoke run")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        spec = json.loads(a.child)
        res = asyncio.run(run_variant(**spec))
        print(json.dumps(res), flush=True)
        sys.exit(0)
    if a.quick:
        a.limit, a.single_limit, a.small_limit, a.n, a.n_small, a.long_latency, a.long_limit = \
            12.0, 10.0, 6.0, 6000, 1500, 4.0, 15.0
    main(a)
