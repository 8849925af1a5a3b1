"""``serving_benchmark``: per recipe, the drafter served in every engine with a serve role, against the
target alone in the same run, over a sweep of settings and concurrency levels (docs/serving.md)."""

import json

import dagster as dg

from eagle3_assets.drafter.assets import drafter_checkpoint, recipe_partitions
from eagle3_assets.metadata import md_table


class ServingBenchmarkConfig(dg.Config):
    chains: list[int] = [1, 3]  # chain lengths (draft tokens per step) swept in every engine
    trees: list[list[int]] = []  # [steps, topk, draft_tokens] trees, in the engines that take them
    concurrency: list[int] = [1, 4]  # requests in flight: 1 and a batch level
    max_new_tokens: int = 32
    engines: list[str] = []  # engines with a serve role to run; empty: all of them
    pythons: dict[str, str] = {}  # engine -> its interpreter; empty: the engine's own environment
    bundled: bool = True  # the project's categorized prompts
    files: list[str] = []  # MT-bench, SPEED-Bench or project-format JSONL/Parquet files with categories
    per_category: int = 2  # rows per category (0: all); a row of k turns gives k prompts
    heldout_per_dataset: int = 2  # prompts of each recipe dataset's held-out split, as heldout:<dataset>
    extra_categories: list[str] = []  # categories of the user's files beyond the known ones
    turn_reply_tokens: int = 512  # the target's greedy reply to each earlier turn of a multi-turn row, at most
    restarts: int = 2  # a server that died is started again this often per setting


def sweep_and_choice(config: ServingBenchmarkConfig):
    from eagle3_assets.serving.stage import PromptChoice
    from eagle3_assets.serving.sweep import SweepSpec

    sweep = SweepSpec(chains=list(config.chains), trees=[tuple(t) for t in config.trees], concurrency=list(config.concurrency),
                      max_new_tokens=config.max_new_tokens, engines=list(config.engines), restarts=config.restarts,
                      pythons=dict(config.pythons))
    choice = PromptChoice(bundled=config.bundled, files=list(config.files), per_category=config.per_category,
                          heldout_per_dataset=config.heldout_per_dataset, extra_categories=list(config.extra_categories),
                          turn_reply_tokens=config.turn_reply_tokens)
    return sweep, choice


def resource_replies(target):
    """The target resource's own model (its device and dtype) answers a multi-turn row's earlier turns."""
    from eagle3_assets.serving.turns import ReplyModel
    from eagle3_assets.target.precision import resolve_device

    device = resolve_device(target.device)
    return ReplyModel(target.load_model, f"{device} {target.torch_dtype(device)}")


@dg.asset(
    partitions_def=recipe_partitions,
    deps=[drafter_checkpoint],
    group_name="serving",
    kinds={"vllm", "sglang"},
    pool="gpu",
    description="The recipe's exports served in each engine against the target alone in the same run: acceptance "
                "by the engines' counters, output tokens/s, time per output token, time to first token and speedup "
                "per setting, concurrency and category; the best setting per engine and concurrency next to the exports.",
    required_resource_keys={"storage", "target"},
)
def serving_benchmark(context: dg.AssetExecutionContext, config: ServingBenchmarkConfig) -> dg.MaterializeResult:
    from eagle3_assets.drafter.recipes import load_recipe
    from eagle3_assets.serving.report import acceptance_plot, provenance_markdown, speedup_plot, table_markdown
    from eagle3_assets.serving.stage import benchmark

    layout, spec = context.resources.storage.layout, context.resources.target.spec()
    recipe = load_recipe(context.partition_key)
    sweep, choice = sweep_and_choice(config)
    result = benchmark(layout, recipe, spec, sweep, choice, replies=resource_replies(context.resources.target),
                       log=context.log.info)
    if result["reused"] and not result["measured"]:
        context.log.info(f"reusing all {result['reused']} cells: the exports, engines, prompts and machine are unchanged")
    elif result["reused"]:
        context.log.info(f"reusing {result['reused']} cells measured before; measured {result['measured']}")
    table = result["table"]
    best = [{"engine": e, "concurrency": c, "setting": b["setting"], "speedup": b["speedup"],
             "acceptance_length": b["acceptance_length"], "serve_command": f"`{b['serve_command']}`"}
            for e, per in result["best"].items() for c, b in per.items()]
    return dg.MaterializeResult(metadata={
        "table": table_markdown(table, pooled_only=True),
        "table_per_category": table_markdown(table),
        "best_settings": md_table(best),
        "speedup_plot": dg.MetadataValue.md(speedup_plot(table)),
        "acceptance_plot": dg.MetadataValue.md(acceptance_plot(table)),
        "provenance": provenance_markdown(table),
        "mismatches": len(result["mismatches"]),
        "contaminated_prompts": len(result["contaminated"]),
        "engines_missing": json.dumps(result["missing"]),
        "engines_skipped": json.dumps(result["skipped"]),
        "cells_measured": result["measured"], "cells_reused": result["reused"], "server_restarts": result["restarts"],
        "wall_s": round(result["wall_s"], 1), "bench_hash": result["bench_hash"], "machine": result["machine"],
        "prompts": len(result["prompts"]),
        "turn_replies": json.dumps(result["turn_replies"]),
        "best_file": dg.MetadataValue.path(str(layout.drafter_dir(recipe.name) / "serving.json")),
    })
