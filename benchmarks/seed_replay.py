"""Benchmark: the original pipeline's job - many datasets through the API at once - launched as a
user launches it, against the engine alone on the same prompts and the same in-flight limit.

Both sides talk to one loopback OpenRouter server in its own process (synthetic replies:
log-normal lengths, an exponential latency plus a per-token time so a reply takes ~3 s, and faults
on: 429, 502, dropped connections, replies billed then dropped, heartbeats). Every dataset has a
token budget (``--budget-share`` makes it bind before its prompts run out; policy ``expected``).

1. **engine alone**: :func:`run_datasets` in this process, every dataset through one gate;
2. **as a user, backfill**: ``dagster dev`` (webserver + daemon) on a fresh instance, then a
   backfill of ``raw_responses`` for every dataset over GraphQL (what the UI's *Materialize* and
   ``eagle3 backfill`` send), timed from the launch until the backfill is complete;
3. **as a user, single run**: the same, launched as one run over the datasets' range (the UI's
   *Pass partition ranges to single run*, ``eagle3 backfill --single-run``): no backfill daemon
   tick (up to 30 s) before the run exists.

Printed: wall times and their ratio (target <= 1.3), the user path broken into launch -> first
request -> last reply -> run ended, the peak and mean in flight the server saw and how many
datasets it saw at once, each dataset's final tokens against its budget, and dollars billed by
the server against dollars kept in rows and reported in the metadata.

    .venv/bin/python benchmarks/seed_replay.py                       # 8 x 500 prompts, 2,000 in flight
    # the original job's shape: each dataset ~12 waves of its 250-request share, budgets binding
    .venv/bin/python benchmarks/seed_replay.py --prompts 3000 --budget-share 0.8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
from results import record

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3_assets.engines.http.samples import SamplingSettings  # noqa: E402
from eagle3_assets.engines.openrouter.backend import OpenRouterBackend  # noqa: E402
from eagle3_assets.generation.admission import AdmissionPolicy  # noqa: E402
from eagle3_assets.generation.dataset_run import prepare_dataset  # noqa: E402
from eagle3_assets.generation.http_engine import EngineSettings, generate_datasets  # noqa: E402
from eagle3_assets.generation.response_store import ResponseStore  # noqa: E402
from eagle3_assets.loopback.process import loopback_process  # noqa: E402
from eagle3_assets.paths import DataLayout  # noqa: E402
from eagle3_assets.prompts.reader import Prompt  # noqa: E402
from eagle3_assets.prompts.table import write_prompt_table  # noqa: E402
from tests.support.dagster_dev import dagster_dev  # noqa: E402

KEY = "sk-or-v1-seed-replay-benchmark"
FAULTS = "429=0.02,502=0.02,drop=0.01,billed_drop=0.01,heartbeat=0.05"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_args(args) -> list[str]:
    return ["openrouter", "--synthetic", "--port", "0", "--api-key", KEY, "--latency", str(args.latency),
            "--latency-exp", "--latency-per-token", str(args.per_token), "--lengths", f"lognormal:{args.median}:{args.sigma}",
            "--faults", FAULTS, "--retry-after", "1", "--seed", "1", "--group-by-prefix", "--uvloop"]


def server_stats(url: str) -> dict:
    return httpx.get(url + "/_loopback/stats", timeout=60).json()


def server_reset(url: str) -> None:
    httpx.get(url + "/_loopback/reset", timeout=60)


class CpuSampler:
    """CPU seconds of a process tree, split into the run worker (the process that generates) and
    the rest of `dagster dev` (webserver, daemon, code server), sampled every second so processes
    that exit are still counted."""

    def __init__(self, root_pid: int):
        self.root = psutil.Process(root_pid)
        self.seen: dict[int, tuple[str, float]] = {}
        self.cmdlines: dict[int, str] = {}
        self.base: dict[int, float] = {}
        self._stop = threading.Event()
        self._sample()
        self.base = {pid: cpu for pid, (_, cpu) in self.seen.items()}
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        for p in [self.root, *self.root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                cmd = " ".join(p.cmdline())
                kind = "run worker" if "execute_run" in cmd or "execute_step" in cmd else "dagster dev"
                self.cmdlines[p.pid] = cmd[:160]
                self.seen[p.pid] = (kind, t.user + t.system)
            except psutil.Error:
                pass

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            self._sample()

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self.thread.join()
        self._sample()
        out: dict[str, float] = {}
        for pid, (kind, cpu) in self.seen.items():
            out[kind] = out.get(kind, 0.0) + cpu - self.base.get(pid, 0.0)
        return out


def write_datasets(layout: DataLayout, names: list[str], n: int) -> None:
    for ds in names:
        prompts = [Prompt(f"p{i}", [{"role": "user", "content": f"{ds}: question {i} - explain step {i % 97}"}], i + 1)
                   for i in range(n)]
        write_prompt_table(prompts, layout.prompt_table(ds))


def dataset_figures(layout: DataLayout, names: list[str], budget: int) -> dict:
    out = {}
    for ds in names:
        store = ResponseStore(layout.responses_dir(ds))
        rows = store.rows()
        tokens = sum(r["completion_tokens"] or 0 for r in rows)
        out[ds] = {"rows": len(rows), "tokens": tokens, "budget": budget, "ratio": tokens / budget,
                   "kept_usd": math.fsum(r.get("cost_usd") or 0.0 for r in rows),
                   "billed_usd": math.fsum(r.get("cost_usd") or 0.0 for r in rows)
                   + math.fsum(b.get("cost_usd") or 0.0 for b in store.billing())}
    return out


def phase_engine_alone(args, url: str, names: list[str], root: Path) -> dict:
    layout = DataLayout(root)
    write_datasets(layout, names, args.prompts)
    server_reset(url)
    billed_before = server_stats(url)["billed_usd"]
    load = os.getloadavg()[0]
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.time()  # from here on, what the asset does too: plan every dataset, then generate
    sampling = SamplingSettings(target="bench")
    preps = [prepare_dataset(layout, ds, sampling, source="openrouter", budget_tokens=args.budget,
                             policy=AdmissionPolicy(args.policy), max_tokens=args.max_tokens) for ds in names]
    backend = OpenRouterBackend(KEY, "moonshotai/kimi-k2.5", base_url=url + "/api/v1")
    settings = EngineSettings(concurrency=args.concurrency, max_tokens=args.max_tokens, progress_every_s=30.0)
    run = generate_datasets([p.job() for p in preps], backend, sampling=sampling, settings=settings,
                            progress=lambda p: print("   engine:", p.line(), flush=True))
    t1 = time.time()
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    stats = server_stats(url)
    stats["billed_usd"] -= billed_before  # the server's bill is cumulative
    cpu = {"engine process": cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime}
    return {"wall_s": t1 - t0, "done_s": t1 - t0, "t0": t0, "stats": stats, "load": load, "cpu": cpu,
            "datasets": dataset_figures(layout, names, args.budget),
            "reported_billed_usd": run.billed_usd, "reported_kept_usd": run.cost_usd}


def phase_user(args, url: str, names: list[str], root: Path, mode: str = "backfill") -> dict:
    """``mode``: "backfill" (the UI's *Materialize* of several partitions, ``eagle3 backfill``) or
    "single run" (the UI's *Pass partition ranges to single run*, ``eagle3 backfill --single-run``)."""
    import dagster as dg

    write_datasets(DataLayout(root), names, args.prompts)
    with dagster_dev(root, env={"OPENROUTER_API_KEY": KEY}) as running:
        server, instance, layout = running.server, running.instance, running.layout
        for ds in names:
            server.add_partition(ds)
        run_config = {
            "ops": {"raw_responses": {"config": {"backend": "openrouter", "concurrency": args.concurrency,
                                                 "max_new_tokens": args.max_tokens, "budget_policy": args.policy}}},
            "resources": {"openrouter": {"config": {"base_url": url + "/api/v1"}},
                          "dataset_settings": {"config": {"default_budget_tokens": args.budget}}},
        }
        if args.executor:
            run_config["execution"] = {"config": {args.executor: {}}}
        server_reset(url)
        billed_before = server_stats(url)["billed_usd"]
        load = os.getloadavg()[0]
        sampler = CpuSampler(running.proc.pid)
        t0 = time.time()
        if mode == "backfill":
            backfill_id = server.launch_backfill(names, ["raw_responses"], run_config, title="seed replay")
            status = server.wait_for_backfill(backfill_id, timeout=args.timeout, poll=5.0)  # light on the webserver
        else:
            run_id = server.launch_range_run(names[0], names[-1], ["raw_responses"], run_config)
            run_status = server.wait_for_run(run_id, timeout=args.timeout, poll=5.0)
            status = {"status": run_status, "runs": [{"runId": run_id, "status": run_status}]}
        t1 = time.time()
        cpu = sampler.stop()
        if args.keep:
            print("   processes:", json.dumps(sampler.cmdlines, indent=1))
        stats = server_stats(url)
        stats["billed_usd"] -= billed_before
        runs = [instance.get_run_by_id(r["runId"]) for r in status["runs"]]
        runs_done = max(instance.get_run_stats(r.run_id).end_time or t1 for r in runs)
        first_run = min(runs, key=lambda r: instance.get_run_record_by_id(r.run_id).create_timestamp.timestamp())
        created = instance.get_run_record_by_id(first_run.run_id).create_timestamp.timestamp()
        started = instance.get_run_stats(first_run.run_id).start_time or created
        step = next((rec.timestamp for rec in instance.all_logs(first_run.run_id, of_type=dg.DagsterEventType.STEP_START)),
                    started)
        launch = {"run created": created - t0, "run worker started": started - created,
                  "step started": step - started, "step setup to first request": stats["first_request_at"] - step}
        mats = {}
        for run in runs:
            for rec in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION):
                m = rec.dagster_event.event_specific_data.materialization
                mats[m.partition] = {k: v.value for k, v in m.metadata.items()
                                     if k in ("new_responses", "billed_usd_new", "cost_usd_new", "budget_overshoot")}
        return {"mode": mode, "wall_s": t1 - t0, "done_s": runs_done - t0, "t0": t0, "status": status["status"],
                "runs": len(runs),
                "stats": stats, "launch": launch, "load": load, "cpu": cpu,
                "datasets": dataset_figures(layout, names, args.budget), "metadata": mats,
                "reported_billed_usd": sum(m.get("billed_usd_new", 0.0) for m in mats.values()),
                "reported_kept_usd": sum(m.get("cost_usd_new", 0.0) for m in mats.values())}


def report(args, alone: dict, users: list[dict]) -> None:
    def window(phase):
        s = phase["stats"]
        first, last = s["first_request_at"], s["last_delivery_at"]
        return first - phase["t0"], last - first, phase["t0"] + phase["done_s"] - last

    phases = [alone, *users]
    names = ["engine alone", *[u["mode"] for u in users]]

    def row(label, values, fmt):
        print(f"{label:30}" + "".join(fmt.format(v) for v in values))

    print(f"\n=== seed replay: {args.datasets} datasets x {args.prompts} prompts, {args.concurrency} in flight, "
          f"budget {args.budget:,} tokens each ({args.policy}), max_tokens {args.max_tokens}")
    row("", names, "{:>16}")
    row("machine load at the start", [p["load"] for p in phases], "{:>16.1f}")
    row("CPU seconds, all processes", [sum(p["cpu"].values()) for p in phases], "{:>16.1f}")
    row("wall time to data, s", [p["done_s"] for p in phases], "{:>16.1f}")
    wins = [window(p) for p in phases]
    for label, i in [("  launch -> first request", 0), ("  first request -> last reply", 1),
                     ("  last reply -> run ended", 2)]:
        row(label, [w[i] for w in wins], "{:>16.1f}")
    row("launch seen as done, s", ["", *[f"{u['wall_s']:.1f}" for u in users]], "{:>16}")
    for u in users:
        print(f"  {u['mode']}: " + ", ".join(f"{k} {v:.1f} s" for k, v in u["launch"].items()))
    for ph, (_, span, _) in zip(phases, wins):  # time-weighted, first request to last reply
        ph["stats"]["mean_in_flight"] = ph["stats"]["concurrency_area"] / span if span > 0 else 0.0
    for label, key, fmt in [("server in flight, peak", "concurrency_peak", "{:>16d}"),
                            ("server in flight, mean", "mean_in_flight", "{:>16.0f}"),
                            ("datasets in flight at once", "groups_at_once_peak", "{:>16d}"),
                            ("requests (with retries)", "requests", "{:>16d}")]:
        row(label, [p["stats"][key] for p in phases], fmt)
    for label, val in [("dollars billed (server)", lambda p: p["stats"]["billed_usd"]),
                       ("dollars billed (reported)", lambda p: p["reported_billed_usd"]),
                       ("dollars kept (rows)", lambda p: sum(d["kept_usd"] for d in p["datasets"].values()))]:
        row(label, [val(p) for p in phases], "{:>16.6f}")
    print()
    for u, w in zip(users, wins[1:]):
        print(f"ratio {u['mode']} / engine alone (launch to data): {u['done_s'] / alone['done_s']:.2f}x (target <= 1.3); "
              f"generation window only: {w[1] / wins[0][1]:.2f}x; {u['status']} in {u['runs']} run(s)")
    print(f"\n{'dataset':10}" + "".join(f"{n + ': tokens':>22}{'/ budget':>10}{'rows':>7}" for n in names)
          + f"{'billed $':>11}{'kept $':>11}")
    last = phases[-1]
    for ds in sorted(alone["datasets"]):
        cells = "".join(f"{p['datasets'][ds]['tokens']:>22,}{p['datasets'][ds]['ratio']:>10.4f}{p['datasets'][ds]['rows']:>7}"
                        for p in phases)
        print(f"{ds:10}{cells}{last['datasets'][ds]['billed_usd']:>11.5f}{last['datasets'][ds]['kept_usd']:>11.5f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", type=int, default=8)
    p.add_argument("--prompts", type=int, default=500, help="prompts per dataset")
    p.add_argument("--concurrency", type=int, default=2000)
    p.add_argument("--latency", type=float, default=2.0, help="mean of the exponential part of a reply's time, s")
    p.add_argument("--per-token", type=float, default=0.006, help="seconds per generated token")
    p.add_argument("--median", type=float, default=120, help="median reply length, tokens (log-normal)")
    p.add_argument("--sigma", type=float, default=0.8, help="log-normal spread of reply lengths")
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--budget-share", type=float, default=0.0,
                   help="each dataset's token budget as a share of what its prompts need (0: the default 10M, never binding)")
    p.add_argument("--policy", choices=["expected", "strict"], default="expected")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--executor", choices=["in_process", "multiprocess", ""], default="in_process",
                   help="the run's executor (eagle3 backfill sends in_process for a generation-only backfill)")
    p.add_argument("--launch", choices=["backfill", "single run", "both"], default="both",
                   help="how the user path launches: a backfill, one ranged run, or both in turn")
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--keep", action="store_true", help="keep the data roots and the instance (to look at the runs)")
    args = p.parse_args()
    mean = args.median * math.exp(args.sigma ** 2 / 2)
    args.budget = int(args.budget_share * args.prompts * mean) if args.budget_share else 10_000_000
    names = [f"set{i}" for i in range(args.datasets)]
    # The target is on disk before the job, as in a deployment (a Kimi checkpoint directory): the
    # bundled SmolLM2 is converted once into the shared cache, never inside the timed runs.
    from eagle3_assets.target.embedded import ensure_default_model

    os.environ["EAGLE3_MODEL_CACHE"] = os.environ.get("EAGLE3_MODEL_CACHE") or str(ROOT / "data" / "models")
    ensure_default_model(Path(os.environ["EAGLE3_MODEL_CACHE"]))
    tmp = Path(tempfile.mkdtemp(prefix="seed-replay-"))
    try:
        with loopback_process(*server_args(args)) as (_, url):
            replay(args, url, names, tmp)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


def replay(args, url: str, names: list[str], tmp: Path) -> None:
    print(f"loopback OpenRouter at {url}; data under {tmp}", flush=True)
    steps = 2 if args.launch != "both" else 3
    print(f"1/{steps} engine alone ...", flush=True)
    alone = phase_engine_alone(args, url, names, tmp / "alone")
    print(f"   {alone['wall_s']:.1f} s", flush=True)
    users = []
    modes = ["backfill", "single run"] if args.launch == "both" else [args.launch]
    for i, mode in enumerate(modes, start=2):
        print(f"{i}/{steps} {mode} through dagster dev ...", flush=True)
        users.append(phase_user(args, url, names, tmp / mode.replace(" ", "-"), mode))
        print(f"   {users[-1]['wall_s']:.1f} s", flush=True)
    report(args, alone, users)
    for ph in (alone, *users):
        ph["stats"].pop("deliveries", None)
        ph["stats"].pop("generated", None)
        ph["stats"].pop("ledger_entries", None)
    figures = {"args": vars(args), "alone": alone, "launched": users}
    record("seed_replay", figures)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
