"""Running a selection of the graph in this process, recorded in the instance (the UI shows it)."""

from __future__ import annotations

import time


def materialize_selection(instance, selection: list[str], partition: str, run_config: dict):
    """One run of the selected assets (and their checks) for one partition, recorded in the instance."""
    import dagster as dg

    from eagle3_assets.definitions import ALL_ASSETS, ALL_CHECKS, default_resources

    return dg.materialize(
        [*ALL_ASSETS, *ALL_CHECKS], selection=selection,
        partition_key=partition, instance=instance, resources=default_resources(), run_config=run_config,
        raise_on_error=False,
    )


def report_result(result, label: str, t0: float) -> bool:
    from dagster import AssetCheckSeverity

    checks = result.get_asset_check_evaluations()
    print(f"=== {label}: {'ok' if result.success else 'FAILED'} in {time.perf_counter() - t0:.0f}s "
          f"(run {result.run_id[:8]}); checks passed {sum(c.passed for c in checks)}/{len(checks)}", flush=True)
    for c in checks:
        if not c.passed:
            kind = "warning" if c.severity == AssetCheckSeverity.WARN else "FAILED"
            print(f"    check {c.check_name} {kind}: {c.description}")
    return result.success
