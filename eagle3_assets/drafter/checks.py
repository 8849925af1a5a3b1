"""``drafter_acceptance``: the serving contract and the acceptance floor, checked on the export."""

import json

import dagster as dg

from eagle3_assets.drafter.assets import drafter_checkpoint, recipe_partitions
from eagle3_assets.metadata import md_table
from resources import StorageResource


@dg.asset_check(asset=drafter_checkpoint, blocking=True, partitions_def=recipe_partitions,
                description="The SGLang and vLLM exports follow their serving contracts (rope, aux layers), and "
                            "speculative decoding on held-out "
                            "prompts reaches the recipe's acceptance floor while reproducing greedy decoding.")
def drafter_acceptance(context: dg.AssetCheckExecutionContext, storage: StorageResource) -> dg.AssetCheckResult:
    from eagle3_assets.drafter.export import check_sglang_export, check_vllm_export
    from eagle3_assets.drafter.recipes import load_recipe

    out = storage.layout.drafter_dir(context.partition_key)
    engines = load_recipe(context.partition_key).shape.engines
    problems = [f"sglang export: {p}" for p in check_sglang_export(out / "sglang")] if "sglang" in engines else []
    problems += [f"vllm export: {p}" for p in check_vllm_export(out / "vllm")] if "vllm" in engines else []
    ev = json.loads((out / "eval.json").read_text()) if (out / "eval.json").exists() else None
    if ev is None:
        problems.append("no eval.json: the drafter was not evaluated")
    else:
        t = ev["trained"]
        if t["acceptance_length"] < ev["floor"]:
            problems.append(f"acceptance length {t['acceptance_length']:.3f} is below the floor {ev['floor']}")
        if not t["matches_greedy"]:
            problems.append("speculative decoding did not reproduce greedy decoding")
    return dg.AssetCheckResult(
        passed=not problems,
        description="; ".join(problems) or f"acceptance length {ev['trained']['acceptance_length']:.3f} >= {ev['floor']}",
        metadata={"acceptance_length": ev["trained"]["acceptance_length"] if ev else None,
                  "untrained": ev["untrained"]["acceptance_length"] if ev else None,
                  "floor": ev["floor"] if ev else None, "problems": md_table([{"problem": p} for p in problems])},
    )

