"""``drafter_acceptance``: the serving contract, the aux layers against training, and the acceptance
floor and margin over an untrained twin, checked on the export."""

import json

import dagster as dg

from eagle3_assets.drafter.assets import drafter_checkpoint, recipe_partitions
from eagle3_assets.metadata import md_table
from eagle3_assets.resources import StorageResource


def acceptance_problems(ev: dict, settings) -> list[str]:
    """Why ``ev`` (eval.json) does not pass the recipe's ``settings`` (its ``EvalSettings``): the
    evaluation must have used the recipe's floor and margin, and the trained drafter must reach the
    floor, beat its untrained twin by the margin and reproduce greedy decoding."""
    problems = []
    floor, margin = settings.acceptance_floor, settings.acceptance_margin
    if ev.get("floor") != floor or ev.get("margin") != margin:
        problems.append(f"eval.json was measured against floor {ev.get('floor')} and margin {ev.get('margin')}, "
                        f"the recipe states floor {floor} and margin {margin}: re-materialize the drafter")
    t, u = ev["trained"]["acceptance_length"], ev["untrained"]["acceptance_length"]
    if t < floor:
        problems.append(f"acceptance length {t:.3f} is below the floor {floor}")
    if t < u + margin:
        problems.append(f"acceptance length {t:.3f} does not beat the untrained drafter's {u:.3f} by the margin {margin}")
    if not ev["trained"]["matches_greedy"]:
        problems.append("speculative decoding did not reproduce greedy decoding")
    return problems


@dg.asset_check(asset=drafter_checkpoint, blocking=True, partitions_def=recipe_partitions,
                description="Each serving engine's export follows its serving contract (rope, aux layers) and "
                            "names the aux layers the drafter was trained on, and every file of each is the one "
                            "eval.json fingerprinted; speculative decoding on held-out prompts reaches the recipe's "
                            "acceptance floor, beats an untrained drafter by the recipe's margin and reproduces "
                            "greedy decoding.")
def drafter_acceptance(context: dg.AssetCheckExecutionContext, storage: StorageResource) -> dg.AssetCheckResult:
    from eagle3_assets.drafter.export_review import evaluation_link_problems, review_exports
    from eagle3_assets.drafter.recipes import load_recipe

    out = storage.layout.drafter_dir(context.partition_key)
    recipe = load_recipe(context.partition_key)
    review = review_exports(out, recipe.shape.engines)
    layers, problems = review.layers, review.problems
    ev = json.loads((out / "eval.json").read_text()) if (out / "eval.json").exists() else None
    if ev is None:
        problems.append("no eval.json: the drafter was not evaluated")
    else:
        problems += acceptance_problems(ev, recipe.evaluation)
        problems += evaluation_link_problems(ev, out, recipe.shape.engines, recipe.name)
    ok = (f"acceptance length {ev['trained']['acceptance_length']:.3f} >= {ev['floor']}, measured on the "
          f"{' and '.join(recipe.shape.engines)} exports there now" if ev else "")
    return dg.AssetCheckResult(
        passed=not problems,
        description="; ".join(problems) or ok,
        metadata={"acceptance_length": ev["trained"]["acceptance_length"] if ev else None,
                  "untrained": ev["untrained"]["acceptance_length"] if ev else None,
                  "floor": ev["floor"] if ev else None, "margin": ev.get("margin") if ev else None,
                  "trained_aux_layer_ids": str(layers["aux_layer_ids"]) if layers else None,
                  "problems": md_table([{"problem": p} for p in problems])},
    )
