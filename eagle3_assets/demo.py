"""``make demo``: the graph materialized for the bundled datasets in a real Dagster instance."""

from __future__ import annotations

import os
import shutil
import time

from eagle3_assets.launch import materialize_selection, report_result
from eagle3_assets.paths import BUNDLED, DataLayout, ensure_dagster_home

DEMO_PROMPTS = BUNDLED / "demo_prompts"

# Sized for a 2-core CPU: 96 prompts x up to 128 new tokens at ~100 tokens/s in batches of 16.
HIDDEN_RUN_CONFIG = {"ops": {"hidden_states": {"config": {}}}, "loggers": {"console": {"config": {"log_level": "INFO"}}}}
DRAFTER_RUN_CONFIG = {"ops": {"drafter_checkpoint": {"config": {}}},
                      "loggers": {"console": {"config": {"log_level": "INFO"}}}}

DEMO_RUN_CONFIG = {
    "ops": {"raw_responses": {"config": {"max_new_tokens": 128, "batch_size": 16}}},
    "loggers": {"console": {"config": {"log_level": "INFO"}}},
}


def install_demo_prompts(layout: DataLayout) -> list[str]:
    """Copy the bundled prompt files into the data root (never overwriting a user's file)."""
    layout.prompts_dir.mkdir(parents=True, exist_ok=True)
    names = []
    for src in sorted(DEMO_PROMPTS.glob("*.jsonl")):
        dst = layout.prompt_source(src.stem)
        if not dst.exists():
            shutil.copyfile(src, dst)
        names.append(src.stem)
    return names


def run_gpu_stages(instance, names: list[str], layout) -> list[str]:
    """Hidden states for each demo dataset, then the demo drafter; returns what failed."""
    import json

    failed = []
    for name in names:
        t0 = time.perf_counter()
        print(f"\n=== hidden_states[{name}]: prefill the corpus through the target, write shards", flush=True)
        result = materialize_selection(instance, ["hidden_states"], name, HIDDEN_RUN_CONFIG)
        if not report_result(result, f"hidden_states[{name}]", t0):
            failed.append(f"hidden_states[{name}]")
    if failed:
        return failed
    t0 = time.perf_counter()
    print("\n=== drafter_checkpoint[demo]: train through Dagster Pipes, export, measure acceptance", flush=True)
    result = materialize_selection(instance, ["drafter_checkpoint"], "demo", DRAFTER_RUN_CONFIG)
    if not report_result(result, "drafter_checkpoint[demo]", t0):
        return ["drafter_checkpoint[demo]"]
    ev = json.loads((layout.drafter_dir("demo") / "eval.json").read_text())
    t, u = ev["trained"], ev["untrained"]
    print(f"\nAcceptance length on {ev['prompts']} held-out prompts (k={ev['k']}, SGLang convention: accepted + 1 "
          f"per verification): trained {t['acceptance_length']:.3f}, untrained baseline {u['acceptance_length']:.3f}; "
          f"without the bonus token {t['acceptance_length_no_bonus']:.3f}; per position "
          f"{', '.join(f'{r:.2f}' for r in t['per_position_rate'])}; equals greedy decoding: {t['matches_greedy']}")
    return []


def run_demo(datasets: list[str] | None = None, run_config: dict | None = None) -> int:
    layout = DataLayout.from_env()
    os.environ.setdefault("DAGSTER_HOME", str(ensure_dagster_home(layout)))
    from dagster import DagsterInstance

    from eagle3_assets.corpus.report import print_inventory
    from eagle3_assets.definitions import dataset_pipeline, defs
    from eagle3_assets.partitions import datasets_partitions

    names = datasets or install_demo_prompts(layout)
    instance = DagsterInstance.get()
    from eagle3_assets.runs import ensure_pool_limits, recover_dead_runs

    ensure_pool_limits(instance)
    for run_id in recover_dead_runs(instance):  # an earlier demo killed mid-run holds pool slots
        print(f"marked dead run {run_id[:8]} failed and freed its pool slots")
    known = set(instance.get_dynamic_partitions(datasets_partitions.name))
    instance.add_dynamic_partitions(datasets_partitions.name, [n for n in names if n not in known])
    job = defs.resolve_job_def(dataset_pipeline.name)
    failed = []
    for name in names:
        t0 = time.perf_counter()
        print(f"\n=== dataset {name}: prompts -> raw_responses -> token_ids -> inventory -> merged_corpus", flush=True)
        result = job.execute_in_process(
            partition_key=name, instance=instance, run_config=run_config or DEMO_RUN_CONFIG, raise_on_error=False
        )
        report_result(result, name, t0)
        if not result.success:
            failed.append(name)
    if not failed and datasets is None:
        failed += run_gpu_stages(instance, names, layout)
    print()
    print_inventory(layout)
    print(f"\nData root: {layout.root}")
    for label, path in [("prompts", layout.prompts_dir), ("responses", layout.root / "responses"),
                        ("token ids", layout.root / "tokens"), ("corpus", layout.root / "corpus"),
                        ("hidden states", layout.root / "hidden_states"), ("drafter", layout.drafter_dir("demo")),
                        ("inventory", layout.metadata_db), ("Dagster instance", layout.dagster_home)]:
        print(f"  {label:<17} {path}")
    print("\nOpen the UI with `make ui` and browse http://127.0.0.1:3000 (Assets -> Lineage; each run is under Runs).")
    return 1 if failed else 0
