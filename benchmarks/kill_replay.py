"""Benchmark: kill a materialization three times, re-run it each time, and compare every figure
the project reports with the provider's own record.

As a new user would: ``dagster asset materialize --select raw_responses`` (OpenRouter backend) in
its own process group against the loopback OpenRouter server in another process (synthetic
replies of ~3 s, 2,000 prompts, 2,000 in flight, about a third of attempts failing in eleven
ways), the whole process group killed with SIGKILL at seeded random moments, the same command
run again after each kill, and once more to the end. The server keeps a ledger of every request
(billed or not, delivered or not) - the independent record everything is checked against:

* first, without a kill, the engine alone in this process on the same prompts and server: for every
  reply, the time from the server handing it to the socket to its row being in the file (the
  window a kill can fall into), and how late the client's event loop ran;
* per kill: replies the server had delivered that are not on disk (how many, how long before the
  kill), and requests in flight that the server finished and billed after the client vanished;
* after the last run: the dollars the server billed against what the project reports (its
  inventory's billed dollars, the last materialization's ``total_billed_usd``, and of it what
  runs that died were billed), dollars kept in rows, replies bought twice.

    .venv/bin/python benchmarks/kill_replay.py                  # ~3-4 minutes on 2 cores
    .venv/bin/python benchmarks/kill_replay.py --seed 7 --json out.json
    .venv/bin/python benchmarks/kill_replay.py --alone-only --latency 30   # the window at ~66 replies/s
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from results import record

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3_assets.corpus.inventory import response_frame, summarize  # noqa: E402
from eagle3_assets.engines.http.samples import SampleRequest, SamplingSettings  # noqa: E402
from eagle3_assets.engines.openrouter.backend import OpenRouterBackend  # noqa: E402
from eagle3_assets.generation import response_store  # noqa: E402
from eagle3_assets.generation.budget import TokenBudget  # noqa: E402
from eagle3_assets.generation.http_engine import generate_http  # noqa: E402
from eagle3_assets.generation.response_store import ResponseStore  # noqa: E402
from eagle3_assets.loopback import messages_key  # noqa: E402
from eagle3_assets.loopback.process import loopback_process  # noqa: E402
from eagle3_assets.paths import DataLayout, ensure_dagster_home  # noqa: E402
from eagle3_assets.prompts.reader import Prompt  # noqa: E402
from eagle3_assets.prompts.table import write_prompt_table  # noqa: E402

KEY = "sk-or-v1-kill-replay-benchmark"
DATASET = "killed"
# eleven ways to fail, 3% each: a third of all attempts
FAULTS = ",".join(f"{f}=0.03" for f in ("429", "408", "500", "502", "503", "524", "529", "error200", "finish_error",
                                        "drop", "billed_drop"))
KEY_USAGE_BEFORE = 12.5  # the key had been used before this job


def server_args(args) -> list[str]:
    return ["openrouter", "--synthetic", "--port", "0", "--api-key", KEY, "--latency", str(args.latency),
            "--latency-exp", "--latency-per-token", str(args.per_token), "--lengths", f"lognormal:{args.median}:0.8",
            "--faults", "" if args.no_faults else FAULTS, "--retry-after", str(args.retry_after), "--seed", str(args.seed),
            "--key-usage", str(KEY_USAGE_BEFORE), "--uvloop"]


def stats(url: str) -> dict:
    return httpx.get(url + "/_loopback/stats", timeout=120).json()


def prepare(root: Path, n: int) -> dict[str, str]:
    """The dataset's prompts and partition; returns prompt id -> the key the server records."""
    import dagster as dg

    layout = DataLayout(root)
    prompts = [Prompt(f"p{i}", [{"role": "user", "content": f"{DATASET}: question {i} - explain step {i % 97}"}], i + 1)
               for i in range(n)]
    write_prompt_table(prompts, layout.prompt_table(DATASET))
    instance = dg.DagsterInstance.from_config(str(ensure_dagster_home(layout)))
    instance.add_dynamic_partitions("datasets", [DATASET])
    instance.dispose()
    return {p.prompt_id: messages_key(p.messages) for p in prompts}


def write_config(root: Path, url: str, args) -> Path:
    cfg = {"ops": {"raw_responses": {"config": {"backend": "openrouter", "concurrency": args.concurrency,
                                                "max_new_tokens": args.max_tokens}}},
           "resources": {"openrouter": {"config": {"base_url": url + "/api/v1"}}}}
    path = root / "run_config.json"
    path.write_text(json.dumps(cfg))
    return path


def launch(root: Path, cfg: Path, log) -> subprocess.Popen:
    """The user's command, in its own process group (what a terminal's Ctrl-\\ or an OOM kill takes down)."""
    env = dict(os.environ, EAGLE3_HOME=str(root), DAGSTER_HOME=str(root / "dagster"), OPENROUTER_API_KEY=KEY)
    cmd = [str(Path(sys.executable).with_name("dagster")), "asset", "materialize", "-m", "eagle3_assets.definitions",
           "--select", "raw_responses", "--partition", DATASET, "-c", str(cfg)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


class RowCounter:
    """Rows on disk, reading only what was appended since the last look."""

    def __init__(self, path: Path):
        self.path, self.pos, self.rows = path, 0, 0

    def count(self) -> int:
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.pos)
                data = fh.read()
        except FileNotFoundError:
            return 0
        self.rows += data.count(b"\n")
        self.pos += len(data)
        return self.rows


def kept_keys(store: ResponseStore, key_of: dict[str, str]) -> set[str]:
    return {key_of[r["prompt_id"]] for r in store.rows()}


def after_kill(url: str, t_launch: float, t_kill: float, store: ResponseStore, key_of: dict[str, str],
               settle: float) -> dict:
    """What this round's kill left: the server's record of the run that was killed against the rows."""
    time.sleep(settle)  # the server finishes what was in flight (and bills it)
    s = stats(url)
    kept = kept_keys(store, key_of)
    mine = [e for e in s["ledger_entries"] if t_launch <= e["received_at"] < t_kill]
    delivered = {}
    for e in mine:  # replies worth a row (billed), handed to the socket before the kill
        if e["billed"] and e["delivered_at"] is not None and e["delivered_at"] < t_kill:
            delivered[e["key"]] = max(delivered.get(e["key"], 0.0), e["delivered_at"])
    lost = {k: t_kill - t for k, t in delivered.items() if k not in kept}
    gone = [e for e in mine if e["lost"] == "client_gone"]
    return {"rows": len(kept), "lost": len(lost), "lost_ages_ms": sorted(round(1000 * a, 1) for a in lost.values()),
            "in_flight_billed_after_kill": len(gone), "in_flight_billed_after_kill_usd": math.fsum(e["cost_usd"] for e in gone),
            "lost_keys": sorted(lost)}


def job_totals(entries: list[dict]) -> dict:
    """The server ledger's totals over these entries (what ``Ledger.totals`` sums, for a slice)."""
    billed = [e for e in entries if e["billed"]]
    return {"requests": len(entries), "billed": len(billed), "billed_usd": math.fsum(e["cost_usd"] for e in billed),
            "delivered": sum(1 for e in billed if e["delivered_at"] is not None),
            "delivered_usd": math.fsum(e["cost_usd"] for e in billed if e["delivered_at"] is not None),
            "billed_undelivered": sum(1 for e in billed if e["lost"] is not None),
            "billed_undelivered_usd": math.fsum(e["cost_usd"] for e in billed if e["lost"] is not None),
            "client_gone": sum(1 for e in entries if e["lost"] == "client_gone")}


def window_alone(url: str, args) -> dict:
    """The engine alone, no kill: per reply, server delivery -> row written (ms), and the loop's lateness."""
    written: dict[str, float] = {}
    plain = response_store.ResponseWriter.write_row

    def write_row(self, row):
        plain(self, row)
        written[row["generation_id"]] = time.time()

    response_store.ResponseWriter.write_row = write_row
    try:
        reqs = [SampleRequest(f"salone{i:06d}", "alone", f"p{i}", 0,
                              [{"role": "user", "content": f"alone: question {i} - explain step {i % 97}"}])
                for i in range(args.prompts)]
        t0 = time.monotonic()
        rep = generate_http(reqs, OpenRouterBackend(KEY, "moonshotai/kimi-k2.5", base_url=url + "/api/v1"),
                            ResponseStore(tempfile.mkdtemp(prefix="kill-replay-alone-")), TokenBudget(10**12),
                            sampling=SamplingSettings("bench"), max_tokens=args.max_tokens,
                            concurrency=args.concurrency)
        wall = time.monotonic() - t0
    finally:
        response_store.ResponseWriter.write_row = plain
    delivered = {e["generation_id"]: e["delivered_at"] for e in stats(url)["ledger_entries"] if e["delivered_at"]}
    ms = sorted(1000 * (t - delivered[g]) for g, t in written.items() if g in delivered)
    q = {f"p{int(100 * p)}": round(ms[int(p * (len(ms) - 1))], 1) for p in (0.5, 0.9, 0.99)} if ms else {}
    return {"rows": rep.new, "wall_s": round(wall, 1), "window_ms": {**q, "max": round(ms[-1], 1) if ms else None},
            "client": getattr(rep, "client", {}), "load": os.getloadavg()[0]}


def last_materialization(root: Path) -> dict:
    import dagster as dg

    instance = dg.DagsterInstance.from_config(str(root / "dagster"))
    try:
        ev = instance.get_latest_materialization_event(dg.AssetKey("raw_responses"))
        md = ev.asset_materialization.metadata if ev else {}
        return {k: getattr(v, "value", v) for k, v in md.items()}
    finally:
        instance.dispose()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=2000)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--seed", type=int, default=1, help="the server's faults and the kill moments")
    p.add_argument("--latency", type=float, default=2.0, help="mean of the exponential part of a reply's time, s")
    p.add_argument("--per-token", type=float, default=0.006)
    p.add_argument("--median", type=float, default=120)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--retry-after", type=float, default=0.5)
    p.add_argument("--settle", type=float, default=8.0, help="seconds after a kill before reading the ledger")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--alone-only", action="store_true", help="only the engine alone's window (no kills)")
    p.add_argument("--no-faults", action="store_true", help="every attempt answered (the window without retry bursts)")
    args = p.parse_args()
    from eagle3_assets.target.embedded import ensure_default_model

    os.environ["EAGLE3_MODEL_CACHE"] = os.environ.get("EAGLE3_MODEL_CACHE") or str(ROOT / "data" / "models")
    ensure_default_model(Path(os.environ["EAGLE3_MODEL_CACHE"]))
    root = Path(tempfile.mkdtemp(prefix="kill-replay-"))
    load = os.getloadavg()
    figures: dict = {"args": vars(args), "load_at_start": load, "kills": []}
    try:
        run_job(args, root, figures, load)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


def run_job(args, root: Path, figures: dict, load) -> None:
    rng = random.Random(args.seed)
    with loopback_process(*server_args(args)) as (_, url):
        key_of = prepare(root, args.prompts)
        cfg = write_config(root, url, args)
        store = ResponseStore(DataLayout(root).responses_dir(DATASET))
        counter = RowCounter(store.path("openrouter"))
        log = (root / "materialize.log").open("ab")
        print(f"loopback OpenRouter at {url}; data under {root}; load {load[0]:.1f}", flush=True)
        alone = figures["engine_alone"] = window_alone(url, args)
        print(f"engine alone, no kill: {alone['rows']} rows in {alone['wall_s']} s; delivered -> on disk "
              f"{alone['window_ms']} ms; client loop late {alone['client']} ms; load {alone['load']:.1f}", flush=True)
        if args.alone_only:
            record("kill_replay_alone", figures)
            return
        ledger_start = len(stats(url)["ledger_entries"])
        for k in range(args.kills):
            before = counter.count()
            target = before + rng.randint(args.prompts // 20, args.prompts // 6)
            t_launch = time.time()
            proc = launch(root, cfg, log)
            deadline = time.monotonic() + args.timeout
            while counter.count() < target and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(rng.uniform(0.005, 0.03))
            t_kill = time.time()
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if proc.returncode != -signal.SIGKILL:
                raise RuntimeError(f"kill {k + 1}: the run ended by itself ({proc.returncode}); see {root}/materialize.log")
            fig = after_kill(url, t_launch, t_kill, store, key_of, args.settle)
            fig["load"] = os.getloadavg()[0]
            figures["kills"].append(fig)
            print(f"kill {k + 1}: {fig['rows']} rows on disk; {fig['lost']} delivered replies not on disk "
                  f"(delivered {fig['lost_ages_ms'][:1] and fig['lost_ages_ms'][0]}-"
                  f"{fig['lost_ages_ms'][-1:] and fig['lost_ages_ms'][-1]} ms before the kill); "
                  f"{fig['in_flight_billed_after_kill']} in flight billed after the kill "
                  f"(${fig['in_flight_billed_after_kill_usd']:.4f}); load {fig['load']:.1f}", flush=True)
        t0 = time.monotonic()
        proc = launch(root, cfg, log)
        rc = proc.wait(timeout=args.timeout)
        print(f"final run: exit {rc} in {time.monotonic() - t0:.1f} s", flush=True)
        time.sleep(1.0)
        s = stats(url)
        s["ledger_entries"] = s["ledger_entries"][ledger_start:]  # the killed and re-run job only
        rows = store.rows()
        inv = summarize(DATASET, response_frame(rows), 10**12, store.billing(), 0).filter(source="all").to_dicts()[0]
        md = last_materialization(root)
        ledger = job_totals(s["ledger_entries"])
        generated = s["generated"]
        lost_keys = {k for f in figures["kills"] for k in f["lost_keys"]}
        twice = {k for k, v in generated.items() if v > 1}
        figures.update({
            "rows": len(rows), "distinct_prompts": len({r["prompt_id"] for r in rows}),
            "server": {k: ledger[k] for k in ("requests", "billed", "billed_usd", "delivered", "delivered_usd",
                                              "billed_undelivered", "billed_undelivered_usd", "client_gone")},
            "project": {"inventory_billed_usd": inv["billed_usd"], "inventory_kept_usd": inv["cost_usd"],
                        "inventory_billed_dead_runs_usd": inv.get("billed_dead_runs_usd"),
                        "metadata_total_billed_usd": md.get("total_billed_usd"),
                        "metadata_total_cost_usd": md.get("total_cost_usd"),
                        "metadata_billed_to_dead_runs_usd": md.get("billed_to_dead_runs_usd")},
            "bought_twice": len(twice), "lost_then_bought_again": len(lost_keys & twice),
            "bought_twice_usd": math.fsum(e["cost_usd"] for e in s["ledger_entries"]
                                          if e["billed"] and e["key"] in twice),
        })
        sv, pj = figures["server"], figures["project"]
        print(f"\n=== kill replay: {args.prompts} prompts, {args.concurrency} in flight, faults {FAULTS} "
              f"(seed {args.seed}), {args.kills} kills of the process group; load at start {load[0]:.1f}")
        print(f"rows on disk {figures['rows']} ({figures['distinct_prompts']} prompts)")
        print(f"server ledger: {sv['requests']} requests, {sv['billed']} billed ${sv['billed_usd']:.6f} = delivered "
              f"{sv['delivered']} ${sv['delivered_usd']:.6f} + billed undelivered {sv['billed_undelivered']} "
              f"${sv['billed_undelivered_usd']:.6f} ({sv['client_gone']} finished after their client was gone)")
        print(f"project: inventory billed ${pj['inventory_billed_usd']:.6f} (kept ${pj['inventory_kept_usd']:.6f}; "
              f"of it billed to runs that died {pj['inventory_billed_dead_runs_usd']}); last materialization "
              f"total_billed_usd {pj['metadata_total_billed_usd']} (billed_to_dead_runs_usd, the last kill's: "
              f"{pj['metadata_billed_to_dead_runs_usd']})")
        gap = sv["billed_usd"] - pj["inventory_billed_usd"]
        print(f"missing from the project's bill: ${gap:.6f} ({100 * gap / sv['billed_usd']:.1f}% of the spend)")
        for i, f in enumerate(figures["kills"], start=1):
            ages = f["lost_ages_ms"]
            cuts = [ages[int(q * (len(ages) - 1))] for q in (0.5, 0.9)] if ages else [0, 0]
            print(f"kill {i}: {f['lost']} delivered replies not on disk, delivered {ages[:1] or '-'}..{ages[-1:] or '-'} "
                  f"ms before the kill (median {cuts[0]}, p90 {cuts[1]})")
        print(f"bought twice: {figures['bought_twice']} prompts (${figures['bought_twice_usd']:.6f} for all their "
              f"generations), of them lost at a kill: {figures['lost_then_bought_again']}")
        for f in figures["kills"]:
            f.pop("lost_keys", None)
        record("kill_replay", figures)
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
