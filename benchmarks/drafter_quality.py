"""Drafter quality from one prompt file: an ablation table of training recipes, both AL figures per row.

From the prompt file (default ``../shared/data/drafter_quality_prompts.jsonl``, 260 prompts) through
the project's own stages in a real Dagster instance under ``--root``: ``prompts -> raw_responses
(embedded target) -> token_ids -> inventory -> merged_corpus -> hidden_states``, once per data
variant (greedy replies, several sampled replies per prompt), cached on disk between rows and runs.
The corpus split hashes the prompt id, so every data variant holds out the same prompts, and no
row ever trains on a held-out prompt.

Each row is one training recipe (``VARIANTS``: today's recipe, each lever alone, combinations),
materialized as ``drafter_checkpoint[<row>]`` (trainer through Dagster Pipes, exports, the
project's evaluator on every held-out prompt), in a fresh process so its peak RSS is its own; then,
when ``.venv-vllm`` exists, a real vLLM server serves the row's vLLM export next to the target and
its own counters give the second acceptance length on the same prompts. Printed per row: AL by the
project's evaluator and by vLLM (k=3 chain, greedy), the trainer's acceptance estimate (EAL) of the
checkpoint it exported (the best by it) and of every scored checkpoint, per-position acceptance,
training tokens/s, training and row wall time, peak RSS; ``table`` adds the estimate's rank
correlation with each evaluator's AL, across rows and across each row's checkpoints.

``--reference`` (or the ``reference`` command) also trains vLLM's ``speculators`` 0.9.0 on the
same train split in its own environment (``--reference-python``; ``bash
benchmarks/reference_env.sh`` builds it), scores it with the same evaluators and caches it as
``results/reference_speculators.json`` (``benchmarks/reference_row.py``); without that
environment it says why in one line.

Run (every heavy piece under the shared lock on a shared box):

    flock /tmp/eagle3-cpu.lock .venv/bin/python benchmarks/drafter_quality.py data
    flock /tmp/eagle3-cpu.lock .venv/bin/python benchmarks/drafter_quality.py row today
    flock /tmp/eagle3-cpu.lock .venv/bin/python benchmarks/drafter_quality.py engines today   # re-measure engines only
    flock /tmp/eagle3-cpu.lock .venv/bin/python benchmarks/drafter_quality.py reference
    .venv/bin/python benchmarks/drafter_quality.py table
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import reference_row
from quality_data import make_data
from quality_eval import checkpoint_curve, replay_row, sglang_row, vllm_row
from quality_recipes import (
    DATA,
    DEFAULT_PROMPTS,
    DEFAULT_ROOT,
    REPO,
    VARIANTS,
    line,
    recipe_table,
    row_name,
    setup_env,
    uptime,
    write_recipe,
)
from quality_table import plot_curves, rank_correlations, result_rows, seed_spread, table, table_figures
from results import record


def train_row(name: str, threads: int) -> dict:
    """(In a fresh process.) drafter_checkpoint[name] in the benchmark's instance: the trainer
    through Pipes, the exports, the project's evaluator on every held-out prompt."""
    import dagster as dg

    from eagle3_assets.launch import materialize_selection
    from eagle3_assets.paths import DataLayout

    layout = DataLayout.from_env()
    out = layout.drafter_dir(name)
    shutil.rmtree(out, ignore_errors=True)  # one run per row, from scratch
    t0 = time.perf_counter()
    result = materialize_selection(dg.DagsterInstance.get(), ["drafter_checkpoint"], name,
                                   {"ops": {"drafter_checkpoint": {"config": {"threads": threads}}}})
    wall = time.perf_counter() - t0
    if not result.success:
        raise SystemExit(f"drafter_checkpoint[{name}] failed (run {result.run_id})")
    trained, ev = json.loads((out / "result.json").read_text()), json.loads((out / "eval.json").read_text())
    checks = {c.check_name: c.passed for c in result.get_asset_check_evaluations()}
    return {"train": trained, "eval": ev, "row_wall_s": wall, "checks": checks,
            "trainer_peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
            "row_process_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def fit_row(root: Path, name: str, threads: int, piece_steps: int) -> dict:
    """(In a fresh process.) One row: the trainer entry point on the recipe's job file, as the
    asset launches it, at most ``piece_steps`` more optimizer steps per call (0: to the end; the
    trainer resumes from its checkpoint), then the replay evaluator on the exported drafter."""
    from eagle3_assets.drafter.recipes import load_recipe
    from eagle3_assets.drafter.training.checkpoints import latest_checkpoint, load_checkpoint
    from eagle3_assets.drafter.training.config import ExportSettings, RuntimeSettings, TrainJob
    from eagle3_assets.paths import DataLayout
    from eagle3_assets.target.embedded import ensure_default_model
    from eagle3_assets.target.ref import TargetRef

    layout = DataLayout.from_env()
    recipe = load_recipe(name)
    out = layout.drafter_dir(name)
    ckpt = latest_checkpoint(out) if out.exists() else None
    done = load_checkpoint(ckpt)["step"] if ckpt else 0
    if ckpt is None:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    job = TrainJob(target=TargetRef(model_dir=str(ensure_default_model(layout.models_dir))), out_dir=str(out),
                   datasets={str(layout.hidden_states_dir(d)): w for d, w in recipe.datasets.items()},
                   training=recipe.training, shape=recipe.shape,
                   runtime=RuntimeSettings(threads=threads, progress=False,
                                           stop_after=done + piece_steps if piece_steps else None),
                   export=ExportSettings())
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "eagle3_assets.drafter.training", "--config", str(job.write(out / "job.json"))],
                   check=True, stdout=subprocess.DEVNULL)
    trained = json.loads((out / "result.json").read_text())
    wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    if trained.get("stopped_early"):
        return {"partial": True, "steps": trained["steps"], "total_steps": trained["total_steps"], "piece_s": wall}
    return {"train": trained, "row_wall_s": time.perf_counter() - t0, "trainer_peak_rss_mib": rss,
            "eval": replay_row(root, name), "curve": checkpoint_curve(root, name)}


def run_row(root: Path, name: str, *, threads: int, vllm: bool, force: bool, scale: float = 1.0,
            piece_steps: int = 0, sglang: bool = True) -> dict:
    rname = row_name(name, scale)
    path = root / "results" / f"{rname}.json"
    if path.exists() and not force:
        print(f"row {rname}: cached in {path} (--force to rerun)")
        return json.loads(path.read_text())
    write_recipe(root, name, scale, curve=True)
    load0 = uptime()
    while True:  # in pieces of --piece-steps steps, each resuming the last checkpoint
        res = subprocess.run([sys.executable, __file__, "_fit", rname, "--root", str(root), "--threads", str(threads),
                              "--piece-steps", str(piece_steps)], capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(f"row {rname} failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
        row = json.loads(res.stdout.strip().splitlines()[-1])
        if not row.get("partial"):
            break
        print(f"row {rname}: {row['steps']}/{row['total_steps']} steps ({row['piece_s']:.0f} s this piece)", flush=True)
    table = recipe_table(name, scale)
    row.update(name=rname, description=table["description"], recipe=table, load_before=load0,
               load_after_training=uptime(), finished_at=time.strftime("%Y-%m-%d %H:%M:%S"))
    row["vllm"] = {"skipped": "not measured (--no-vllm)"}
    row["sglang"] = {"skipped": "not measured (--no-sglang)"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(row, indent=2))  # the trained row is kept whatever an engine does next
    return measure_engines(root, rname, vllm=vllm, sglang=sglang)


def measure_engines(root: Path, rname: str, *, vllm: bool = True, sglang: bool = True) -> dict:
    """vLLM's and SGLang's counters on a trained row's exports, written into its result file as
    each finishes; ``engines <row>`` reruns this alone on a row that already has results."""
    path = root / "results" / f"{rname}.json"
    if not path.exists():
        raise SystemExit(f"row {rname}: no result file {path}; train it first (row {rname})")
    row = json.loads(path.read_text())
    for engine, wanted, measure in (("vllm", vllm, vllm_row), ("sglang", sglang, sglang_row)):
        if wanted:
            row[engine] = measure(root, rname, row["eval"])
            row["load_after"] = uptime()
            path.write_text(json.dumps(row, indent=2))
    print(f"row {rname}: {line(row)}", flush=True)
    return row


def run_final(root: Path, name: str, *, threads: int) -> dict:
    """A row end to end through Dagster: ``drafter_checkpoint[<row>_asset]`` materialized in the
    benchmark's instance (trainer through Pipes, exports, the real chain decoder on every held-out
    prompt, the ``drafter_acceptance`` check), then vLLM on its export; the replay evaluator on the
    same export is printed beside the decoder, which it must equal."""
    rname = f"{name}_asset"
    table = recipe_table(name)
    write_recipe(root, name, out_name=rname)
    load0 = uptime()
    res = subprocess.run([sys.executable, __file__, "_train", rname, "--root", str(root), "--threads", str(threads)],
                         capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"final {rname} failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
    row = json.loads(res.stdout.strip().splitlines()[-1])
    row.update(name=rname, description=table["description"] + " (through the asset, real decoder)", recipe=table,
               load_before=load0, finished_at=time.strftime("%Y-%m-%d %H:%M:%S"), replay=replay_row(root, rname))
    row["vllm"] = vllm_row(root, rname, row["eval"])
    row["sglang"] = sglang_row(root, rname, row["eval"])
    path = root / "results" / f"{rname}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(row, indent=2))
    print(f"final {rname}: {line(row)}; replay evaluator {row['replay']['trained']['acceptance_length']:.3f}; "
          f"checks {row['checks']}", flush=True)
    return row


def speed_once(root: Path, mode: str, steps: int, threads: int) -> dict:
    """(In a fresh process.) The BASE recipe's first ``steps`` optimizer steps on ``dq``, packed
    (the trainer) or padded (the yardstick: every padded position computed, teacher included)."""
    from eagle3_assets.drafter.training.config import RuntimeSettings, TrainJob
    from eagle3_assets.drafter.training.job import run_job
    from eagle3_assets.paths import DataLayout
    from eagle3_assets.target.embedded import ensure_default_model
    from eagle3_assets.target.ref import TargetRef

    layout = DataLayout.from_env()
    base = write_recipe(root, "today")
    from eagle3_assets.drafter.recipes import parse_recipe

    recipe = parse_recipe(base)
    out = root / "speed" / mode
    shutil.rmtree(out, ignore_errors=True)
    job = TrainJob(target=TargetRef(model_dir=str(ensure_default_model(layout.models_dir))), out_dir=str(out),
                   datasets={str(layout.hidden_states_dir(d)): w for d, w in recipe.datasets.items()},
                   training=recipe.training.model_copy(update={"max_steps": steps, "epochs": None}), shape=recipe.shape,
                   runtime=RuntimeSettings(threads=threads, progress=False, packed=mode == "packed"), export=None)
    losses = []
    summary = run_job(job, on_metrics=lambda m: losses.append(m["loss"]))
    return {"mode": mode, "tokens_per_s": summary["tokens_per_s"], "wall_s": summary["wall_s"], "losses": losses,
            "data_share": summary["data_share"], "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def speed(root: Path, steps: int, threads: int) -> None:
    """Packed vs padded training side by side in fresh processes: tokens/s and the loss curves."""
    runs = {}
    for mode in ("padded", "packed"):
        res = subprocess.run([sys.executable, __file__, "_speed", mode, "--root", str(root), "--threads", str(threads),
                              "--steps", str(steps)], capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(res.stderr[-3000:])
        runs[mode] = json.loads(res.stdout.strip().splitlines()[-1])
        print(f"{mode:>7}: {runs[mode]['tokens_per_s']:.0f} training tokens/s over {steps} steps "
              f"({runs[mode]['wall_s']:.0f} s, data share {100 * runs[mode]['data_share']:.1f}%, "
              f"peak RSS {runs[mode]['peak_rss_mib']:.0f} MiB), load {uptime()}", flush=True)
    a, b = runs["padded"], runs["packed"]
    diff = max(abs(x - y) / max(abs(x), 1e-9) for x, y in zip(a["losses"], b["losses"]))
    record("drafter_quality_speed", {"steps": steps, "threads": threads, "runs": runs, "max_relative_loss_difference": diff,
                                     "packed_over_padded": b["tokens_per_s"] / a["tokens_per_s"]})
    print(f"packed / padded tokens/s = {b['tokens_per_s'] / a['tokens_per_s']:.2f}; largest relative loss difference "
          f"over the {steps} steps {diff:.2e} (first loss {a['losses'][0]:.4f} vs {b['losses'][0]:.4f}, "
          f"last {a['losses'][-1]:.4f} vs {b['losses'][-1]:.4f})")


def reference_status(python: str) -> str | None:
    """Why the reference trainer (speculators 0.9.0) cannot run beside the rows, or None."""

    return reference_row.status(python)


def run_reference(args) -> None:
    """speculators 0.9.0 beside the rows (``reference_row.py``), or one line saying why not."""

    reference_row.run(args.root.resolve(), args.reference_python, threads=args.threads, vllm=not args.no_vllm, force=args.force,
        epochs=args.reference_epochs, limit=args.reference_limit)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["data", "speed", "row", "engines", "table", "reference", "final", "_train", "_fit",
                                        "_speed"])
    ap.add_argument("names", nargs="*", help="data variants (data) or rows (row, table); default: all")
    ap.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    ap.add_argument("--backend", choices=["vllm", "local"], default="vllm", help="data: who writes the replies")
    ap.add_argument("--max-samples", type=int, default=0, help="data: new replies per dataset in this run (0: all)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the trainer")
    ap.add_argument("--no-vllm", action="store_true", help="rows: skip the vLLM server measurement")
    ap.add_argument("--no-sglang", action="store_true", help="rows: skip the SGLang server measurement")
    ap.add_argument("--force", action="store_true", help="rows: rerun rows that have results")
    ap.add_argument("--scale", type=float, default=1.0, help="rows: screening runs at this share of the epochs")
    ap.add_argument("--steps", type=int, default=30, help="speed: optimizer steps per run")
    ap.add_argument("--piece-steps", type=int, default=0,
                    help="screening rows: train in resumable pieces of this many steps (0: one piece)")
    ap.add_argument("--reference", action="store_true", help="rows: also train speculators 0.9.0 on the same data "
                    "(once; cached as results/reference_speculators.json)")
    ap.add_argument("--reference-python", default=str(REPO / ".venv-speculators" / "bin" / "python"))
    ap.add_argument("--reference-epochs", type=int, default=None, help="reference: a smoke run of this many epochs")
    ap.add_argument("--reference-limit", type=int, default=None, help="reference: a smoke run on the first N train rows")
    ap.add_argument("--record", default="drafter_quality",
                    help="table: the results file's name (a later run's rows need not replace an earlier run's)")
    args = ap.parse_args(argv)
    setup_env(args.root.resolve())
    if args.command == "data":
        make_data(args.root, args.prompts, args.names or list(DATA), backend=args.backend, max_samples=args.max_samples)
    elif args.command == "_train":
        print(json.dumps(train_row(args.names[0], args.threads)))
    elif args.command == "_fit":
        print(json.dumps(fit_row(args.root, args.names[0], args.threads, args.piece_steps)))
    elif args.command == "_speed":
        print(json.dumps(speed_once(args.root, args.names[0], args.steps, args.threads)))
    elif args.command == "speed":
        speed(args.root, args.steps, args.threads)
    elif args.command == "row":
        for name in args.names or list(VARIANTS):
            run_row(args.root, name, threads=args.threads, vllm=not args.no_vllm, sglang=not args.no_sglang,
                    force=args.force, scale=args.scale,
                    piece_steps=args.piece_steps)
        if args.reference:
            run_reference(args)
    elif args.command == "engines":
        for name in args.names or list(VARIANTS):
            if (args.root / "results" / f"{name}.json").exists() or args.names:
                measure_engines(args.root, name, vllm=not args.no_vllm, sglang=not args.no_sglang)
    elif args.command == "final":
        for name in args.names:
            run_final(args.root, name, threads=args.threads)
    elif args.command == "reference":
        run_reference(args)
    elif args.command == "table":
        print(table(args.root, args.names))
        rows = result_rows(args.root, args.names)
        record(args.record, {r["name"]: table_figures(r) for r in rows})
        record(f"{args.record}_eal", rank_correlations(rows))  # the rank correlations the table printed
        if spread := seed_spread(rows):  # each recipe's spread over its seeds
            record(f"{args.record}_seeds", spread)
        png = plot_curves(args.root, args.names, args.root / "results" / "acceptance_over_training.png")
        if png:
            print(f"acceptance over training: {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
