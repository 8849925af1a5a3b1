import os
import subprocess
import sys
from pathlib import Path

import dagster as dg

from eagle3_assets.definitions import defs
from eagle3_assets.paths import REPO_ROOT
from eagle3_assets.resources import StorageResource
from eagle3_assets.sensors import prompt_files_sensor
from tests.conftest import small_prompts, write_jsonl


def tick(instance, cursor=None):
    ctx = dg.build_sensor_context(instance=instance, cursor=cursor, definitions=defs,
                                  resources={"storage": StorageResource()})
    return prompt_files_sensor(ctx)


def test_sensor_adds_a_partition_per_new_prompt_file(layout):
    write_jsonl(layout.prompt_source("alpha"), small_prompts(2))
    write_jsonl(layout.prompt_source("beta"), small_prompts(2))
    (layout.prompts_dir / "notes.txt").write_text("ignored")
    with dg.instance_for_test() as instance:
        result = tick(instance)
        assert isinstance(result, dg.SensorResult)
        assert [r.partition_keys for r in result.dynamic_partitions_requests] == [["alpha", "beta"]]
        assert sorted(r.partition_key for r in result.run_requests) == ["alpha", "beta"]
        instance.add_dynamic_partitions("datasets", ["alpha", "beta"])
        assert isinstance(tick(instance), dg.SkipReason)
        write_jsonl(layout.prompt_source("gamma"), small_prompts(1))
        again = tick(instance)
        assert [r.partition_keys for r in again.dynamic_partitions_requests] == [["gamma"]]


def test_definitions_load_and_validate_through_workspace_yaml(layout):
    env = dict(os.environ, DAGSTER_HOME=str(layout.root / "dagster"))
    Path(env["DAGSTER_HOME"]).mkdir(parents=True)
    out = subprocess.run(
        [str(Path(sys.executable).with_name("dagster")), "definitions", "validate", "-w", "workspace.yaml"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "eagle3_assets" in out.stdout + out.stderr


def test_graph_shape():
    graph = defs.resolve_asset_graph()
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert keys == {"prompts", "raw_responses", "token_ids", "inventory", "merged_corpus", "hidden_states",
                    "drafter_checkpoint", "serving_benchmark"}
    serving = next(k for k in graph.get_all_asset_keys() if k.to_user_string() == "serving_benchmark")
    assert {k.to_user_string() for k in graph.get(serving).parent_keys} == {"drafter_checkpoint"}
    blocking = {c.name for c in defs.resolve_asset_graph().asset_check_keys}
    assert {"special_tokens_valid", "reconstruction_consistency", "token_rows_intact", "token_budget", "corpus_integrity",
            "shard_integrity", "drafter_acceptance", "serving_outputs_equal_baseline", "serving_prompts_not_trained_on",
            "serving_provenance"} <= blocking
