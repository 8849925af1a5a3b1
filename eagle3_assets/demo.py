"""``make demo``: the graph materialized for the bundled datasets in a real Dagster instance."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from eagle3_assets.paths import REPO_ROOT, DataLayout, ensure_dagster_home

DEMO_PROMPTS = REPO_ROOT / "demo" / "prompts"

# Sized for a 2-core CPU: 96 prompts x up to 192 new tokens at ~100 tokens/s in batches of 16.
DEMO_RUN_CONFIG = {
    "ops": {"raw_responses": {"config": {"max_new_tokens": 192, "batch_size": 16}}},
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


def run_demo(datasets: list[str] | None = None, run_config: dict | None = None) -> int:
    layout = DataLayout.from_env()
    os.environ.setdefault("DAGSTER_HOME", str(ensure_dagster_home(layout)))
    from dagster import AssetCheckSeverity, DagsterInstance

    from eagle3_assets.cli import print_inventory
    from eagle3_assets.definitions import dataset_pipeline, defs
    from eagle3_assets.partitions import datasets_partitions

    names = datasets or install_demo_prompts(layout)
    instance = DagsterInstance.get()
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
        status = "ok" if result.success else "FAILED"
        checks = result.get_asset_check_evaluations()
        passed = sum(1 for c in checks if c.passed)
        print(f"=== {name}: {status} in {time.perf_counter() - t0:.0f}s (run {result.run_id[:8]}); "
              f"checks passed {passed}/{len(checks)}", flush=True)
        for c in checks:
            if not c.passed:
                kind = "warning" if c.severity == AssetCheckSeverity.WARN else "FAILED"
                print(f"    check {c.check_name} {kind}: {c.description}")
        if not result.success:
            failed.append(name)
    print()
    print_inventory(layout)
    print(f"\nData root: {layout.root}")
    for label, path in [("prompts", layout.prompts_dir), ("responses", layout.root / "responses"),
                        ("token ids", layout.root / "tokens"), ("corpus", layout.root / "corpus"),
                        ("inventory", layout.metadata_db), ("Dagster instance", layout.dagster_home)]:
        print(f"  {label:<17} {path}")
    print("\nOpen the UI with `make ui` and browse http://127.0.0.1:3000 (Assets -> Lineage; each run is under Runs).")
    return 1 if failed else 0
