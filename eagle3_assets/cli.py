"""``eagle3``: the command line for what users do outside the UI."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from eagle3_assets.errors import UserInputError
from eagle3_assets.paths import DataLayout, check_dataset_name, ensure_dagster_home


def cmd_inventory(args) -> int:
    from eagle3_assets.corpus.report import print_inventory

    print_inventory(DataLayout.from_env(args.root))
    return 0


def cmd_add_dataset(args) -> int:
    """Validate a prompt file in one streaming pass, copy it into the data root, add its partition."""
    import time

    from eagle3_assets.paths import prompt_file_dataset, prompt_file_suffix
    from eagle3_assets.prompts.options import ReadOptions, parse_column_map
    from eagle3_assets.prompts.reader import PromptReader

    layout = DataLayout.from_env(args.root)
    src = Path(args.file)
    suffix = prompt_file_suffix(src)
    if suffix is None:
        raise UserInputError(f"{src}: a prompt file ends in .jsonl, .jsonl.gz or .parquet")
    name = check_dataset_name(args.name or prompt_file_dataset(src))
    options = ReadOptions(columns=parse_column_map(args.map or []), skip_invalid_rows=args.skip_invalid,
                          final_assistant="drop" if args.drop_final_assistant else "refuse",
                          tools_in_system_turn=args.tools_in_system_turn,
                          prompt_per_assistant_turn=args.prompt_per_assistant_turn)
    reader = PromptReader(src, options)
    last = time.monotonic()
    for _ in reader:  # validation only: nothing is kept, so a 10 GB file needs no memory
        if time.monotonic() - last > 10:
            last = time.monotonic()
            print(f"  {reader.rows:,} rows read, {reader.skipped:,} bad so far", file=sys.stderr)
    reader.finish()
    dst = layout.prompt_file(name, suffix)
    existing = layout.prompt_sources(name)
    if existing and not args.force:
        raise UserInputError(f"{', '.join(map(str, existing))} exists; pass --force to replace it")
    _install_prompt_file(layout, name, src, dst, options)
    from eagle3_assets.partitions import datasets_partitions

    instance = _instance(layout)
    if not instance.has_dynamic_partition(datasets_partitions.name, name):
        instance.add_dynamic_partitions(datasets_partitions.name, [name])
    if reader.skipped:
        print("skipped bad rows (the prompts asset skips them too):\n" + reader.log.summary(reader.rows, hint=""),
              file=sys.stderr)
    dropped = f", {reader.final_assistant_dropped} final assistant turns dropped" if reader.final_assistant_dropped else ""
    if reader.conversations != reader.accepted:
        dropped += f", from {reader.conversations} conversations"
    print(f"dataset {name!r}: {reader.accepted} prompts ({reader.skipped} bad rows skipped{dropped}) -> {dst}; "
          f"partition added")
    return 0


def _install_prompt_file(layout: DataLayout, name: str, src: Path, dst: Path, options) -> None:
    """Read options first, then the file by an atomic rename (the sensor never sees half a file or a
    file without its column map); another file of the same dataset goes."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    opts_path = layout.prompt_read_options(name)
    if options.is_default:
        opts_path.unlink(missing_ok=True)
    else:
        options.save(opts_path)
    if src.resolve() != dst.resolve():
        tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    for other in layout.prompt_sources(name):
        if other != dst:
            other.unlink()


def cmd_demo(args) -> int:
    from eagle3_assets.demo import run_demo, use_target

    if args.target:
        use_target(args.target)
    return run_demo(args.datasets or None)


def _instance(layout: DataLayout):
    os.environ.setdefault("DAGSTER_HOME", str(ensure_dagster_home(layout)))
    from dagster import DagsterInstance

    from eagle3_assets.runs import ensure_pool_limits

    instance = DagsterInstance.get()
    ensure_pool_limits(instance)
    return instance


THROUGH = {
    "merged_corpus": ["prompts", "raw_responses", "token_ids", "inventory", "merged_corpus"],
    "hidden_states": ["prompts", "raw_responses", "token_ids", "inventory", "merged_corpus", "hidden_states"],
}


def cmd_materialize(args) -> int:
    """One in-process run of a dataset's stages, recorded in the instance (visible in the UI)."""
    layout = DataLayout.from_env(args.root)
    name = check_dataset_name(args.dataset)
    if not layout.prompt_source(name).exists():
        print(f"no prompt file {layout.prompt_source(name)}; add one with `eagle3 add-dataset`", file=sys.stderr)
        return 2
    instance = _instance(layout)
    from eagle3_assets.launch import materialize_selection, report_result
    from eagle3_assets.partitions import datasets_partitions
    from eagle3_assets.runs import recover_dead_runs

    for run_id in recover_dead_runs(instance):  # their pool slots would hold this run's steps
        print(f"run {run_id} was left started by a process that is gone: marked failed, its pool slots freed")

    if not instance.has_dynamic_partition(datasets_partitions.name, name):
        instance.add_dynamic_partitions(datasets_partitions.name, [name])
    run_config = {
        "ops": {"raw_responses": {"config": {"max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size}}},
        "loggers": {"console": {"config": {"log_level": "INFO"}}},
    }
    import time

    t0 = time.perf_counter()
    result = materialize_selection(instance, THROUGH[args.through], name, run_config)
    ok = report_result(result, f"{name} through {args.through}", t0)
    return 0 if ok else 1


def cmd_backfill(args) -> int:
    """A partition backfill submitted to a running webserver (its daemon runs it).

    ``raw_responses`` runs every selected dataset in one step, but only the partitions whose
    prompts are materialized when the daemon looks; so when ``prompts`` is selected too, the prompts
    are backfilled first and generation after them, in one run and one in-flight gate."""
    from eagle3_assets.graphql_client import DagsterWebserver, WebserverError

    names = [check_dataset_name(n) for n in args.datasets]
    assets = [a.strip() for a in args.assets.split(",") if a.strip()]
    generation = {k: v for k, v in [("max_new_tokens", args.max_new_tokens), ("backend", args.backend),
                                    ("concurrency", args.concurrency), ("budget_policy", args.budget_policy)] if v}
    # generation is one step per run: in-process spares the step its own Python process
    run_config = {"ops": {"raw_responses": {"config": generation}}, "execution": {"config": {"in_process": {}}}}
    stages = [["prompts"], [a for a in assets if a != "prompts"]] \
        if "prompts" in assets and "raw_responses" in assets and len(assets) > 1 else [assets]
    server = DagsterWebserver(args.url)
    status = None
    try:
        for n in names:
            server.add_partition(n)
        if args.single_run:
            return _single_run(server, names, assets, run_config, args.wait)
        for i, stage in enumerate(stages):
            backfill_id = server.launch_backfill(names, stage, run_config if "raw_responses" in stage else None)
            print(f"backfill {backfill_id}: {', '.join(names)} over {', '.join(stage)}"
                  f"{' (' + ', '.join(f'{k}={v}' for k, v in generation.items()) + ')' if generation else ''}\n"
                  f"  {args.url.rstrip('/')}/runs/b/{backfill_id}", flush=True)
            if i + 1 < len(stages) or args.wait:
                if i + 1 < len(stages):
                    print("  waiting for the prompts, so that generation serves every dataset in one run", flush=True)
                status = server.wait_for_backfill(backfill_id, timeout=args.wait or 900)
                failed = [r["runId"] for r in status["runs"] if r["status"] != "SUCCESS"]
                print(f"backfill {backfill_id} {status['status']}: {len(status['runs'])} run(s), "
                      f"{len(failed)} not successful")
                if failed:
                    return 1
    except WebserverError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _single_run(server, names: list[str], assets: list[str], run_config: dict, wait: float) -> int:
    """``raw_responses`` for a contiguous range of datasets as one run (no backfill daemon tick)."""
    from eagle3_assets.graphql_client import WebserverError

    if assets != ["raw_responses"]:
        raise WebserverError("--single-run launches raw_responses only (--assets raw_responses): the other assets "
                             "run one dataset per run; backfill them afterwards")
    keys = server.partition_keys("raw_responses")
    pos = sorted(keys.index(n) for n in names)
    if pos[-1] - pos[0] + 1 != len(pos):
        between = [k for k in keys[pos[0]:pos[-1] + 1] if k not in names]
        raise WebserverError(f"--single-run needs a contiguous range of datasets (in the order they were added); "
                             f"{', '.join(between)} lie between them: select them too, or drop --single-run")
    first, last = keys[pos[0]], keys[pos[-1]]
    run_id = server.launch_range_run(first, last, assets, run_config)
    print(f"run {run_id}: raw_responses for {first} .. {last} ({len(pos)} datasets) in one run\n"
          f"  {server.url}/runs/{run_id}", flush=True)
    if wait:
        status = server.wait_for_run(run_id, timeout=wait)
        print(f"run {run_id} {status}")
        return 0 if status == "SUCCESS" else 1
    return 0


def cmd_export(args) -> int:
    """Where a recipe's drafter exports are, and whether each follows its serving contract, names
    the layers the drafter was trained on and is the files ``eval.json`` measured (the review
    ``drafter_acceptance`` runs). Exit 1: an export breaks its serving contract; 2: no recipe of that
    name (or a bad one), no export yet, layers that are not training's (both lists printed), or files
    other than the ones evaluated."""
    from eagle3_assets.drafter.export_review import evaluation_link_problems, review_exports
    from eagle3_assets.drafter.recipes import load_recipe
    from eagle3_assets.drafter.training.acceptance import exported_line
    from eagle3_assets.engines import engine_role

    layout = DataLayout.from_env(args.root)
    out = layout.drafter_dir(args.recipe)
    recipe = load_recipe(args.recipe)
    engines = recipe.shape.engines
    print(f"recipe            {args.recipe}\ndrafter dir       {out}\n"
          + "".join(f"{e + ' export':<18}{out / e}\n" for e in engines), end="")
    if (out / "result.json").exists() and (line := exported_line(json.loads((out / "result.json").read_text()))):
        print(f"{'trained weights':<18}{line}")
    if not any((out / e).exists() for e in engines):
        print(f"no export yet: materialize drafter_checkpoint[{args.recipe}] first", file=sys.stderr)
        return 2
    review = review_exports(out, engines)
    for e in engines:
        print(f"{e + ' aux layers':<18}trained {review.trained_ids(e)} ({e} numbering)")
    ev = out / "eval.json"
    linked = (evaluation_link_problems(json.loads(ev.read_text()), out, engines, args.recipe) if ev.exists() else
              [f"no eval.json: the exports were never evaluated; materialize drafter_checkpoint[{args.recipe}]"])
    if review.problems or linked:
        print("exports INVALID:", file=sys.stderr)
        for p in review.problems + linked:
            print(f"  - {p}", file=sys.stderr)
        return 2 if review.layer_problems or linked else 1
    print("exports ok, name the trained layers and are the files eval.json measured; serve them with:")
    k = recipe.evaluation.speculative_k
    for e in engines:  # each engine's serve role says its command
        print(f"  {engine_role('serve', e).user_command('<target>', out / e, k=k)}")
    _print_best(out)
    return 0


def _print_best(out: Path) -> None:
    """The serving benchmark's best setting per engine and concurrency (``serving.json``), as a serve command."""
    from eagle3_assets.serving.stage import read_best

    best = read_best(out)
    if not best:
        print(f"no serving benchmark yet (serving.json): `eagle3 serve-bench {out.name}` measures the best setting")
        return
    print("fastest setting measured by the serving benchmark (serving.json), per engine and concurrency:")
    for engine, per in best.items():
        for conc, b in per.items():
            slower = " (slower than the target alone: serve it without speculation there)" if b["speedup"] < 1 else ""
            print(f"  {engine} at concurrency {conc}: {b['setting']}, {b['speedup']}x, acceptance {b['acceptance_length']} "
                  f"({b['provenance']['engine_version']}){slower}\n    {b['serve_command']}")


def cmd_serve_bench(args) -> int:
    """``serving_benchmark[recipe]`` in this process, recorded in the instance (visible in the UI)."""
    import time

    from eagle3_assets.launch import materialize_selection, report_result

    layout = DataLayout.from_env(args.root)
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    config = {"chains": ints(args.chains), "concurrency": ints(args.concurrency), "max_new_tokens": args.max_new_tokens,
              "engines": [e for e in args.engines.split(",") if e], "files": [str(Path(f).resolve()) for f in args.file],
              "per_category": args.per_category, "turn_reply_tokens": args.turn_reply_tokens}
    t0 = time.perf_counter()
    result = materialize_selection(_instance(layout), ["serving_benchmark"], args.recipe,
                                   {"ops": {"serving_benchmark": {"config": config}}})
    ok = report_result(result, f"serving_benchmark[{args.recipe}]", t0)
    _print_best(layout.drafter_dir(args.recipe))
    return 0 if ok else 1


def cmd_recover(args) -> int:
    from eagle3_assets.runs import recover_dead_runs

    ids = recover_dead_runs(_instance(DataLayout.from_env(args.root)))
    print(f"recovered {len(ids)} dead run(s){': ' + ', '.join(ids) if ids else ''}")
    return 0


def cmd_paths(args) -> int:
    layout = DataLayout.from_env(args.root)
    print(f"data root        {layout.root}\nmetadata db      {layout.metadata_db}\n"
          f"dagster home     {layout.dagster_home}\nmodel cache      {layout.models_dir}")
    return 0


def cmd_ui(args) -> int:
    """The Dagster webserver and daemon on 127.0.0.1 against the project's instance."""
    from eagle3_assets.paths import write_workspace

    layout = DataLayout.from_env(args.root)
    env = dict(os.environ, DAGSTER_HOME=str(ensure_dagster_home(layout)), EAGLE3_HOME=str(layout.root))
    _instance(layout)  # explicit pool limits before the daemon starts
    cmd = [sys.executable, "-m", "dagster", "dev", "-w", str(write_workspace(layout)),
           "-h", "127.0.0.1", "-p", str(args.port)]
    print(f"Dagster UI on http://127.0.0.1:{args.port} (instance {env['DAGSTER_HOME']}); Ctrl-C stops it.")
    os.execve(cmd[0], cmd, env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagle3", description=__doc__)
    parser.add_argument("--root", help="data root (default: $EAGLE3_HOME or ./data)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("inventory", help="print the inventory of every dataset").set_defaults(fn=cmd_inventory)
    p = sub.add_parser("add-dataset", help="copy a prompt file into the data root and add its partition")
    p.add_argument("file")
    p.add_argument("--name", help="dataset name (default: the file's stem)")
    p.add_argument("--skip-invalid", action="store_true", help="accept a file with bad rows (they are skipped)")
    p.add_argument("--map", action="append", metavar="KEY=COLUMN",
                   help="columns that differ: user=instruction+input, system=COL, id=COL, messages=COL, "
                        "conversations=COL, tools=COL, chat=COL (glaive's text; repeat or comma-separate)")
    p.add_argument("--drop-final-assistant", action="store_true",
                   help="a conversation ending with the assistant's reply becomes the prompt for that reply")
    p.add_argument("--prompt-per-assistant-turn", action="store_true",
                   help="a prompt for every assistant turn of a conversation (the prefix before it), not only its last")
    p.add_argument("--tools-in-system-turn", action="store_true",
                   help="for a target whose chat template renders no tools: write them into the system turn")
    p.add_argument("--force", action="store_true", help="replace the dataset's prompt file")
    p.set_defaults(fn=cmd_add_dataset)
    p = sub.add_parser("demo", help="materialize the graph for the bundled demo datasets")
    p.add_argument("datasets", nargs="*")
    p.add_argument("--target", default="", help="a bundled target (smollm2, kimi-mini) or a checkpoint directory; "
                   "a target other than smollm2 keeps its data under <root>/targets/<name>")
    p.set_defaults(fn=cmd_demo)
    sub.add_parser("paths", help="print where files live").set_defaults(fn=cmd_paths)
    sub.add_parser("recover", help="fail runs whose process was killed and free their pool slots"
                   ).set_defaults(fn=cmd_recover)
    p = sub.add_parser("materialize", help="run a dataset's stages in this process (recorded in the instance)")
    p.add_argument("dataset")
    p.add_argument("--through", choices=sorted(THROUGH), default="merged_corpus")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.set_defaults(fn=cmd_materialize)
    p = sub.add_parser("backfill", help="submit a partition backfill to a running webserver")
    p.add_argument("datasets", nargs="+")
    p.add_argument("--assets", default=",".join(THROUGH["merged_corpus"]),
                   help="comma-separated asset keys (default: prompts through merged_corpus)")
    p.add_argument("--url", default=os.environ.get("EAGLE3_DAGSTER_URL", "http://127.0.0.1:3000"))
    p.add_argument("--max-new-tokens", type=int, default=0, help="raw_responses max_new_tokens (default: its config)")
    p.add_argument("--backend", choices=["local", "sglang", "openrouter", "vllm"], help="raw_responses backend (default: local)")
    p.add_argument("--concurrency", type=int, default=0,
                   help="HTTP backends: requests in flight for all the datasets together (default: the resource's)")
    p.add_argument("--budget-policy", choices=["expected", "strict"], help="token budget admission (default: expected)")
    p.add_argument("--single-run", action="store_true",
                   help="with --assets raw_responses: one run over the datasets' range instead of a backfill, as the "
                        "UI's 'Pass partition ranges to single run' (starts without waiting for the backfill daemon)")
    p.add_argument("--wait", type=float, default=0, help="wait up to this many seconds for the backfill to finish")
    p.set_defaults(fn=cmd_backfill)
    p = sub.add_parser("export", help="print a recipe's drafter exports, validate them, compare their aux layers with training")
    p.add_argument("recipe")
    p.set_defaults(fn=cmd_export)
    p = sub.add_parser("serve-bench", help="serve a recipe's exports in each engine against the target alone and sweep")
    p.add_argument("recipe")
    p.add_argument("--chains", default="1,3", help="chain lengths to sweep (draft tokens per step)")
    p.add_argument("--concurrency", default="1,4", help="requests in flight")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--per-category", type=int, default=2, help="rows per category (0: all); a row of k turns gives k prompts")
    p.add_argument("--engines", default="", help="comma-separated serve engines (default: every one)")
    p.add_argument("--file", action="append", default=[], help="a benchmark file (MT-bench, SPEED-Bench or project rows)")
    p.add_argument("--turn-reply-tokens", type=int, default=512,
                   help="the target's reply to each earlier turn of a multi-turn row, at most (made once, cached)")
    p.set_defaults(fn=cmd_serve_bench)
    p = sub.add_parser("ui", help="serve the Dagster webserver and daemon on 127.0.0.1")
    p.add_argument("--port", type=int, default=3000)
    p.set_defaults(fn=cmd_ui)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except UserInputError as e:  # the user's to fix: the message, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
