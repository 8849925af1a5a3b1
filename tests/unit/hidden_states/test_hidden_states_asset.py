"""``hidden_states`` materialized by Dagster on a real corpus, then checked and read back."""

import json

import dagster as dg
import pytest

from eagle3_assets.hidden_states.reader import ShardReader
from tests.conftest import small_prompts, write_jsonl
from tests.support.dagster_helpers import checks_by_name, run_dataset, run_hidden_states

pytestmark = pytest.mark.model


def test_hidden_states_after_the_corpus(layout, model_dir):
    write_jsonl(layout.prompt_source("hs"), small_prompts(4))
    with dg.instance_for_test() as instance:
        assert run_dataset(instance, "hs").success
        result = run_hidden_states(instance, "hs", config={"shard_bytes": 200_000})
        assert result.success
        assert checks_by_name(result)["shard_integrity"].passed
        meta = result.asset_materializations_for_node("hidden_states")[0].metadata
        manifest = json.loads((layout.hidden_states_dir("hs") / "manifest.json").read_text())
        assert meta["tokens"].value == manifest["num_tokens"] > 0
        assert meta["bytes_per_token"].value <= 1.01 * (8 * 576 + 5)
        assert manifest["layers"]["aux_layer_ids"] == [1, 14, 26]
        reader = ShardReader(layout.hidden_states_dir("hs"))
        sid = reader.sample_ids()[0]
        sample = reader.read(sid)
        assert sample.aux_hidden.shape[1] == 3 * 576 and sample.last_hidden.shape[1] == 576

        again = run_hidden_states(instance, "hs", config={"shard_bytes": 200_000})
        assert again.success
        meta2 = again.asset_materializations_for_node("hidden_states")[0].metadata
        assert meta2["extracted_now"].value == 0 and meta2["already_done"].value == 4
