"""The reference row of ``benchmarks/drafter_quality.py``: speculators 0.9.0 trained beside the rows.

``drafter_quality.py reference`` (or ``row <names> --reference``) runs it once and caches
``results/reference_speculators.json`` next to the rows; ``table`` prints it as a row. Steps, each
in a fresh process so every peak RSS is its own:

1. ``reference_convert.py to-speculators`` (project environment): the ``train`` split of the
   BASE row's dataset (``dq``) as speculators' per-sample files, the final state recomputed
   before the target's norm (kept under ``<root>/reference/data`` and reused while the shards
   are unchanged);
2. ``reference_speculators.py`` (``.venv-speculators``): speculators' own trainer on it, CPU
   patches applied at run time, BASE's draft vocabulary, TTT steps, epochs and lr;
3. ``reference_row.py eval`` (project environment): its checkpoint converted to the project's
   SGLang layout (``drafters/<name>/sglang``; its own checkpoint, as it is, is the
   ``drafters/<name>/vllm`` export), the conversion checked against speculators' own drafts,
   then the replay evaluator on the same held-out prompts as the rows (``replay_row``);
4. when ``.venv-vllm`` exists, a real vLLM server serves speculators' own checkpoint next to the
   target and its counters give the second figure (``vllm_row``).

Every heavy piece runs inside the calling command: put that under ``flock /tmp/eagle3-cpu.lock``
on a shared box (nothing here takes the lock itself, which would wait on the caller's).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from quality_eval import replay_row, vllm_row
from quality_recipes import BASE, line, setup_env, toml_value, uptime

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
NAME = "reference_speculators"
DATASET = "dq"  # the BASE row's dataset
DESCRIPTION = ("speculators 0.9.0 (vLLM's reference trainer): its own recipe with BASE's draft vocab, TTT steps, "
               "epochs and lr; SGLang layout")
BUILD_HINT = "build it with `bash benchmarks/reference_env.sh` (speculators==0.9.0 on the CPU torch, in .venv-speculators)"
DEFAULT_PYTHON = REPO / ".venv-speculators" / "bin" / "python"


def status(python: Path | str = DEFAULT_PYTHON) -> str | None:
    """Why speculators 0.9.0 cannot run here, in one line, or None."""
    py = Path(python)
    if not py.is_file():
        return f"no reference environment at {py}: {BUILD_HINT}"
    probe = subprocess.run(
        [str(py), "-c", "import importlib.metadata as m, speculators.train.cli; print(m.version('speculators'))"],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    version = probe.stdout.strip()
    if probe.returncode or version != "0.9.0":
        why = (probe.stderr.strip().splitlines() or [version or "no output"])[-1][-200:]
        return f"{py} cannot run speculators 0.9.0 ({why}): {BUILD_HINT}"
    return None


def result_name(epochs: int, limit: int | None) -> str:
    """The cached row's name: the full run's, or a smoke run's (fewer epochs or rows)."""
    name = NAME if epochs == BASE["epochs"] else f"{NAME}_e{epochs}"
    return f"{name}_n{limit}" if limit else name


def write_recipe(root: Path, name: str, epochs: int, limit: int | None) -> dict:
    """The BASE recipe under the reference row's name: the evaluators read its dataset, held-out
    prompts and decoding settings (k, reply length) from it, as they do for every row."""
    table = {**BASE, "epochs": epochs,
             "description": DESCRIPTION + (f" (short run: {epochs} epochs" + (f", {limit} rows" if limit else "") + ")"
                                           if name != NAME else "")}
    lines = [f"{k} = {toml_value(v)}" for k, v in table.items() if k != "datasets"]
    lines += ["[datasets]", *(f"{d} = {float(w)}" for d, w in table["datasets"].items())]
    (root / "recipes").mkdir(parents=True, exist_ok=True)
    (root / "recipes" / f"{name}.toml").write_text("\n".join(lines) + "\n")
    return table


def _run(cmd: list[str], log: Path, what: str) -> dict:
    """A step in its own process, its output in ``log``; its last stdout line is JSON."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=out, text=True)
    if res.returncode:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"reference: {what} failed (exit {res.returncode}; log {log}):\n{res.stdout[-1000:]}\n{tail}")
    with open(log, "a") as out:
        out.write(res.stdout)
    return json.loads(res.stdout.strip().splitlines()[-1])


def convert(root: Path, data_dir: Path, target: Path, limit: int | None) -> dict:
    """Step 1, reused while the shards and the row count are the ones converted before."""
    from eagle3_assets.paths import DataLayout

    hs = DataLayout.from_env().hidden_states_dir(DATASET)
    manifest = json.loads((hs / "manifest.json").read_text())
    record = data_dir / "conversion.json"
    if record.exists():
        old = json.loads(record.read_text())
        if old.get("source_updated_at") == manifest.get("updated_at") and old.get("limit") == limit:
            return old
    shutil.rmtree(data_dir, ignore_errors=True)
    cmd = [sys.executable, str(HERE / "reference_convert.py"), "to-speculators", str(hs), str(data_dir), "--target", str(target)]
    if limit:
        cmd += ["--limit", str(limit)]
    out = _run(cmd, data_dir.parent / f"convert-{data_dir.name}.log", "data conversion")
    out["limit"] = limit
    record.write_text(json.dumps(out, indent=2))
    return out


def run(root: Path, python: Path | str = DEFAULT_PYTHON, *, threads: int = 2, vllm: bool = True, force: bool = False,
        epochs: int | None = None, limit: int | None = None) -> dict | None:
    """Train, convert, score and cache the reference row; None (and one line saying why) when
    speculators cannot run here."""
    epochs = int(epochs or BASE["epochs"])
    name = result_name(epochs, limit)
    path = root / "results" / f"{name}.json"
    if path.exists() and not force:
        print(f"reference {name}: cached in {path} (--force to rerun)")
        return json.loads(path.read_text())
    why = status(python)
    if why:
        print(f"reference (speculators 0.9.0) cannot run: {why}")
        return None
    from eagle3_assets.paths import DataLayout
    from eagle3_assets.target.embedded import ensure_default_model

    layout = DataLayout.from_env()
    target = ensure_default_model(layout.models_dir).resolve()
    recipe = write_recipe(root, name, epochs, limit)
    work = root / "reference"
    load0, t0 = uptime(), time.perf_counter()
    data_dir = work / ("data" if not limit else f"data_n{limit}")
    conversion = convert(root, data_dir, target, limit)
    print(f"reference {name}: {conversion['samples']} {conversion['split']} rows, {conversion['tokens']} tokens "
          f"converted (recomputed vs stored: {json.dumps(conversion['recomputed_vs_stored'])})", flush=True)

    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)  # speculators resumes from any checkpoint it finds: start clean
    run_dir.mkdir(parents=True)
    trained = _run([str(python), str(HERE / "reference_speculators.py"), "--data", str(data_dir), "--run", str(run_dir),
                    "--target", str(target), "--target-layer-ids", *map(str, conversion["speculators_layer_ids"]),
                    "--epochs", str(epochs), "--threads", str(threads)],
                   run_dir / "train.log", "speculators training")
    print(f"reference {name}: trained {trained['optimizer_steps']} steps, {trained['tokens_per_s']} tok/s, "
          f"{trained['train_s']:.0f} s, peak RSS {trained['peak_rss_mib']} MiB", flush=True)
    load_trained = uptime()

    ev = _run([sys.executable, str(HERE / "reference_row.py"), "eval", name, trained["checkpoint"], str(run_dir),
               "--root", str(root)], run_dir / "eval.log", "conversion and replay evaluation")
    row = {
        "name": name, "description": recipe["description"], "recipe": recipe, "trainer": "speculators",
        "train": {**trained, "wall_s": trained["train_s"]}, "conversion": conversion,
        "export": ev["export"], "parity": ev["parity"],
        "eval": _eval_entry(ev["replay"]),
        "trainer_peak_rss_mib": trained["peak_rss_mib"], "load_before": load0, "load_after_training": load_trained,
    }
    try:  # a server that fails must not lose the trained and scored row
        row["vllm"] = vllm_row(root, name, row["eval"]) if vllm else {"skipped": "not measured (--no-vllm)"}
    except Exception as e:  # noqa: BLE001
        row["vllm"] = {"skipped": f"failed: {type(e).__name__}: {str(e)[-300:]}"}
    row.update(row_wall_s=time.perf_counter() - t0, load_after=uptime(), finished_at=time.strftime("%Y-%m-%d %H:%M:%S"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(row, indent=2))
    print(f"reference {name}: {line(row)}", flush=True)
    return row


def _eval_entry(replay: dict) -> dict:
    """A row's ``eval`` entry from ``replay_row``'s answer (the trained drafter's figures, with or
    without an untrained baseline beside them)."""
    if "trained" in replay:
        return {"untrained": None, "evaluator": "replay", **replay}
    return {"trained": replay, "untrained": None, "prompts": replay["prompts"], "k": replay["k"],
            "max_new_tokens": replay["max_new_tokens"], "evaluator": "replay"}


def evaluate(root: Path, name: str, checkpoint: Path, run_dir: Path) -> dict:
    """(In a fresh process.) Step 3: the SGLang-layout export, the check against speculators'
    own drafts, speculators' checkpoint as the vLLM export, the replay evaluator."""
    from reference_convert import draft_agreement, to_project

    from eagle3_assets.drafter import formats
    from eagle3_assets.drafter.evaluate import load_export
    from eagle3_assets.drafter.target_weights import read_target_embeddings
    from eagle3_assets.paths import DataLayout
    from eagle3_assets.target.embedded import ensure_default_model

    layout = DataLayout.from_env()
    target = ensure_default_model(layout.models_dir)
    out = layout.drafter_dir(name)
    shutil.rmtree(out, ignore_errors=True)
    sglang = to_project(checkpoint, out, target)
    vllm = out / "vllm"  # speculators' own export, as it wrote it
    vllm.mkdir(parents=True)
    for f in ("config.json", "model.safetensors"):
        shutil.copyfile(Path(checkpoint) / f, vllm / f)
    drafter = load_export(out, read_target_embeddings(target)).float().eval()
    parity = draft_agreement(drafter, Path(run_dir) / "parity.safetensors")
    replay = replay_row(root, name)
    return {"export": {"sglang": str(sglang), "vllm": str(vllm), "checkpoint": str(checkpoint),
                       "vllm_export_problems": formats.check("vllm", vllm)},
            "parity": parity, "replay": replay}


def table_rows(root: Path) -> list[dict]:
    """The cached reference rows (the full run first), for ``quality_table.table``."""
    rows = [json.loads(p.read_text()) for p in sorted((root / "results").glob(f"{NAME}*.json"))]
    return sorted(rows, key=lambda r: r["name"] != NAME)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="the reference row's evaluation step (run by drafter_quality.py)")
    ap.add_argument("command", choices=["eval"])
    ap.add_argument("name")
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--root", type=Path, required=True)
    args = ap.parse_args(argv)
    setup_env(args.root.resolve())
    print(json.dumps(evaluate(args.root.resolve(), args.name, args.checkpoint, args.run_dir)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
