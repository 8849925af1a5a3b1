"""Checks on ``serving_benchmark``: outputs equal the baseline's, no benchmark prompt in the training
data, every figure with its provenance (and the engines that were not measured, named)."""

import json

import dagster as dg

from eagle3_assets.drafter.assets import recipe_partitions
from eagle3_assets.metadata import md_table
from eagle3_assets.resources import StorageResource
from eagle3_assets.serving.assets import serving_benchmark


def _result(storage: StorageResource, recipe: str) -> dict | None:
    from eagle3_assets.serving.stage import serving_dir

    path = serving_dir(storage.layout, recipe) / "result.json"
    return json.loads(path.read_text()) if path.exists() else None


def _missing(recipe: str) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(passed=False, description=f"no serving/result.json: materialize serving_benchmark[{recipe}]")


def mismatch_lines(result: dict) -> list[str]:
    return [f"prompt {m['prompt']} ({m['category']}) differs from the baseline under {m['engine']} {m['setting']} at "
            f"concurrency {m['concurrency']}, first at output token {m['first_difference_at']}" for m in result["mismatches"]]


@dg.asset_check(asset=serving_benchmark, blocking=True, partitions_def=recipe_partitions,
                description="With greedy sampling every output of every setting equals the engine's baseline output for "
                            "the same prompt, token for token; a mismatch names the prompt and the setting.")
def serving_outputs_equal_baseline(context: dg.AssetCheckExecutionContext, storage: StorageResource) -> dg.AssetCheckResult:
    result = _result(storage, context.partition_key)
    if result is None:
        return _missing(context.partition_key)
    lines = mismatch_lines(result)
    return dg.AssetCheckResult(passed=not lines, description="; ".join(lines[:20]) or "every output equals the baseline's",
                               metadata={"mismatches": len(lines), "table": md_table(result["mismatches"][:50])})


@dg.asset_check(asset=serving_benchmark, blocking=True, partitions_def=recipe_partitions,
                description="No benchmark prompt is in the recipe's training data (rendered ids, and each user turn "
                            "asked alone, against the train split's prompts): an acceptance measured on training "
                            "prompts says nothing.")
def serving_prompts_not_trained_on(context: dg.AssetCheckExecutionContext, storage: StorageResource) -> dg.AssetCheckResult:
    result = _result(storage, context.partition_key)
    if result is None:
        return _missing(context.partition_key)
    dirty = result["contaminated"]
    lines = [f"benchmark prompt {d['prompt']} ({d['category']}, {d['source']}) is in the training data of "
             f"{d['training_dataset']}" + (f" ({d['match']}, asked alone)" if d.get("match", "prompt") != "prompt" else "")
             for d in dirty]
    return dg.AssetCheckResult(passed=not dirty, description="; ".join(lines[:20]) or
                               f"none of the {len(result['prompts'])} prompts is in the training data",
                               metadata={"contaminated": len(dirty)})


@dg.asset_check(asset=serving_benchmark, partitions_def=recipe_partitions,
                description="Every figure carries its provenance (export sha256, engine and version, serve command, "
                            "benchmark hash, machine); engines missing from the machine or skipped are named.")
def serving_provenance(context: dg.AssetCheckExecutionContext, storage: StorageResource) -> dg.AssetCheckResult:
    from eagle3_assets.serving.provenance import complete

    result = _result(storage, context.partition_key)
    if result is None:
        return _missing(context.partition_key)
    bad = [r for r in result["table"] if not complete(r["provenance"])]
    not_run = {**{e: f"missing: {w}" for e, w in result["missing"].items()},
               **{e: f"skipped: {w}" for e, w in result["skipped"].items()}}
    measured = sorted({r["engine"] for r in result["table"]})
    problems = [f"{r['engine']} {r['setting']} c{r['concurrency']} {r['category']} lacks provenance" for r in bad]
    if not measured:
        problems.append("no engine was measured: " + "; ".join(f"{e} {w}" for e, w in not_run.items()))
    return dg.AssetCheckResult(
        passed=not problems, severity=dg.AssetCheckSeverity.WARN if not measured and not bad else dg.AssetCheckSeverity.ERROR,
        description="; ".join(problems) or f"measured {', '.join(measured)}; " + ("; ".join(
            f"{e} {w}" for e, w in not_run.items()) or "no engine missing or skipped"),
        metadata={"engines_measured": ", ".join(measured), "engines_not_run": json.dumps(not_run)})


SERVING_CHECKS = [serving_outputs_equal_baseline, serving_prompts_not_trained_on, serving_provenance]
