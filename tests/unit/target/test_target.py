"""One target for every stage: its identity, its names, and training that refuses another target's shards."""

import json

import dagster as dg
import polars as pl
import pytest
import torch

from eagle3_assets.engines.roles import Features
from eagle3_assets.hidden_states.extract import extract_corpus
from eagle3_assets.resources import TargetResource
from eagle3_assets.target import layers as hidden_layers
from eagle3_assets.target.identity import TargetMismatchError, target_identity
from eagle3_assets.target.spec import TargetSpec
from tests.support.dagster_helpers import run_drafter

H = 576


def test_identity_is_stable_and_tells_checkpoints_apart(model_dir, tmp_path):
    a, b = target_identity(model_dir), target_identity(model_dir)
    assert a == b and a["name"] == model_dir.name and len(a["id"]) == 16
    # the same weights under another config (say, a longer context) are another target
    other = tmp_path / "SmolLM2-long"
    other.mkdir()
    for f in model_dir.iterdir():
        if f.is_file():
            (other / f.name).symlink_to(f)
    config = json.loads((model_dir / "config.json").read_text())
    (other / "config.json").unlink()
    (other / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16384}))
    changed = target_identity(other)
    assert changed["id"] != a["id"] and changed["weights_sha256"] == a["weights_sha256"]



def test_a_job_carries_the_target_as_one_reference_opened_once(model_dir, tmp_path):
    """TargetRef survives the job file; opened, its sizes are config.json's (the language model's part
    of a multimodal wrapper); a directory without a config is named."""
    from eagle3_assets.target.ref import TargetRef

    ref = TargetRef.of(TargetResource().spec())
    again = TargetRef.model_validate_json(ref.model_dump_json())
    assert again == ref and ref.identity == target_identity(model_dir) and ref.model_dir == str(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    opened = again.open()
    assert (opened.num_layers, opened.hidden_size, opened.vocab_size) == (
        config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, H, 49152)
    wrapped = tmp_path / "wrapped"
    wrapped.mkdir()
    (wrapped / "config.json").write_text(json.dumps({"model_type": "wrapper", "text_config": {**config, "hidden_size": 64}}))
    assert TargetRef(model_dir=str(wrapped)).open().hidden_size == 64
    with pytest.raises(ValueError, match=f"target {tmp_path}: cannot read config.json"):
        TargetRef(model_dir=str(tmp_path)).open()

def test_the_resource_names_the_target_once(model_dir):
    spec = TargetResource().spec()
    assert spec.model_dir == model_dir and spec.name == spec.served_name == "SmolLM2-135M-Instruct"
    assert spec.text_config["num_hidden_layers"] == 30
    named = TargetResource(name="smol", served_name="org/smol").spec()
    assert (named.name, named.served_name) == ("smol", "org/smol")
    assert named.identity["id"] == spec.identity["id"]  # names are labels; the checkpoint is the identity
    with pytest.raises(FileNotFoundError, match="neither a bundled target"):
        TargetResource(model="/no/such/checkpoint").spec()


class OtherTarget:
    """Stand-in states recorded as coming from another model: only the manifest matters here."""

    hidden_size, vocab_size = H, 49152

    def describe(self):
        return {"target": {"name": "Other-7B", "id": "0123456789abcdef"},
                "layers": hidden_layers.convention([1, 14, 26], 30), "backend": "fake"}

    def extract(self, rows):
        return [Features(torch.zeros(len(r), 3 * H), torch.zeros(len(r), H)) for r in rows]


def _corpus(path, n=4):
    rows = [{"sample_id": f"s{i}", "split": "train", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}
            for i in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    pl.DataFrame(rows, schema_overrides={"input_ids": pl.List(pl.Int32), "loss_mask": pl.List(pl.Int8)}).write_parquet(path)
    return path


def test_training_refuses_shards_of_another_target_naming_both(layout, model_dir):
    from eagle3_assets.drafter.evaluate import train_split_sizes
    from eagle3_assets.drafter.recipes import load_recipe

    for name in load_recipe("demo").datasets:
        extract_corpus(_corpus(layout.corpus(name)), layout.hidden_states_dir(name), OtherTarget(),
                       background_writes=False)
    spec = TargetSpec(model_dir)
    with pytest.raises(TargetMismatchError) as err:
        train_split_sizes(layout, {"general": 1.0}, spec)
    message = str(err.value)
    assert "Other-7B (id 0123456789abcdef)" in message
    assert f"SmolLM2-135M-Instruct (id {spec.identity['id']})" in message

    # through the asset: the run fails before any training process starts
    with dg.instance_for_test() as instance:
        result = run_drafter(instance, "demo")
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert "Other-7B" in str(failure.event_specific_data.error)
    assert not (layout.drafter_dir("demo") / "checkpoints").exists()
