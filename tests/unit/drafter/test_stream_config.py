"""``drafter_checkpoint``'s ``stream`` config as the producers get it: the capture engine's job
settings through its extract role, refusals naming the setting, and the interpreter a user names
reaching the command each launcher runs."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import polars as pl
import pytest

from eagle3_assets.drafter.assets import StreamingConfig
from eagle3_assets.drafter.stream_jobs import longest_corpus, producer_settings
from eagle3_assets.launchers import Launch, local_command
from eagle3_assets.resources import SlurmResource, TargetResource, VLLMResource
from eagle3_assets.slurm.script import entry_command


def corpus(path, lengths):
    pl.DataFrame({"sample_id": [f"s{i}" for i in range(len(lengths))], "split": ["train"] * len(lengths),
                  "input_ids": [list(range(n)) for n in lengths]}).write_parquet(path)
    return str(path)


def test_the_longest_row_picks_the_corpus_an_engine_is_sized_for(tmp_path):
    short, long = corpus(tmp_path / "a.parquet", [5, 9]), corpus(tmp_path / "b.parquet", [300])
    assert longest_corpus({short: 1.0, long: 0.5}) == long


def test_each_engine_gets_its_own_producer_settings(tmp_path, model_dir):
    corpora = {corpus(tmp_path / "a.parquet", [5]): 1.0, corpus(tmp_path / "b.parquet", [300]): 1.0}
    target = TargetResource(model=str(model_dir), device="cpu", dtype="float32")
    resources = SimpleNamespace(target=target, vllm=VLLMResource(extraction_concurrency=3),
                                slurm=SlurmResource(vllm_python="/opt/vllm/bin/python"))
    spec = target.spec()

    assert producer_settings(StreamingConfig(backend="local"), target, resources, corpora, spec) == {}

    vllm = producer_settings(StreamingConfig(backend="vllm", tp_size=2, vllm_server_args=["--seed", "1"]),
                             target, resources, corpora, spec)["vllm"]
    # the server each producer starts: sized for the recipe's longest row (300 + 1, to 512), the resources' settings
    assert (vllm.max_model_len, vllm.tensor_parallel_size, vllm.extra_args) == (512, 2, ["--seed", "1"])
    assert (vllm.python, vllm.concurrency, vllm.dtype, vllm.enforce_eager) == ("/opt/vllm/bin/python", 3, "float32", True)

    sglang = producer_settings(StreamingConfig(backend="sglang", sglang_server_args={"mem_fraction_static": 0.5}),
                               target, resources, corpora, spec)
    assert sglang == {"server_args": {"mem_fraction_static": 0.5}, "tp_size": 1}
    with pytest.raises(ValueError, match=r"stream.tp_size 2 for backend 'sglang'.*stream.producers"):
        producer_settings(StreamingConfig(backend="sglang", tp_size=2), target, resources, corpora, spec)


def test_an_unknown_engine_is_refused_by_the_config_schema():
    with pytest.raises(Exception, match="backend"):
        StreamingConfig(backend="tgi")


def test_a_launch_runs_with_the_interpreter_it_names():
    plain = Launch("p", "eagle3_assets.hidden_states.spool", ["--config", "p.json"])
    assert local_command(plain)[0] == sys.executable
    assert entry_command(plain, "/nodes/python")[0] == "/nodes/python"
    other = Launch("p", "eagle3_assets.hidden_states.spool", ["--config", "p.json"], python="/envs/sglang/bin/python")
    assert local_command(other) == ["/envs/sglang/bin/python", "-m", "eagle3_assets.hidden_states.spool", "--config", "p.json"]
    assert entry_command(other, "/nodes/python")[0] == "/envs/sglang/bin/python"


def test_the_preflight_rates_come_from_the_config_or_from_earlier_materializations():
    """Rates read back from a real Dagster instance's materializations: none recorded -> unknown; the
    datasets' extraction -> capture per producer; a streamed run of the recipe -> its capture rate per
    producer and its training rate with the trainer's waits taken out; the config's override both."""
    import dagster as dg

    from eagle3_assets.drafter.stream_jobs import measured_rates

    recipe = SimpleNamespace(name="r", datasets={"a": 1.0, "b": 1.0})
    stream = StreamingConfig(producers=2)
    with dg.instance_for_test() as instance:
        assert measured_rates(instance, recipe, stream) == {
            "capture_tokens_per_s": None, "train_tokens_per_s": None, "rates_from": "capture: unknown; training: unknown"}

        for dataset, rate in (("a", 100.0), ("b", 300.0)):
            instance.report_runless_asset_event(dg.AssetMaterialization("hidden_states", partition=dataset,
                                                                        metadata={"tokens_per_s": rate}))
        rates = measured_rates(instance, recipe, stream)
        assert (rates["capture_tokens_per_s"], rates["train_tokens_per_s"]) == (400.0, None)  # 200 a producer, 2 of them
        assert rates["rates_from"] == "capture: hidden_states runs; training: unknown"

        instance.report_runless_asset_event(dg.AssetMaterialization(
            "drafter_checkpoint", partition="r",
            metadata={"tokens_per_s": 150.0, "stream_trainer_wait_share": 0.25, "stream_capture_tokens_per_s": 90.0}))
        instance.report_runless_asset_event(dg.AssetMaterialization(  # another recipe's run is not this one's
            "drafter_checkpoint", partition="other", metadata={"tokens_per_s": 1.0, "stream_capture_tokens_per_s": 1.0}))
        rates = measured_rates(instance, recipe, stream)
        assert (rates["capture_tokens_per_s"], rates["train_tokens_per_s"]) == (180.0, 200.0)
        assert rates["rates_from"] == "capture: last streamed run; training: last training run"

        given = measured_rates(instance, recipe, StreamingConfig(capture_tokens_per_s=5.0, train_tokens_per_s=7.0))
        assert (given["capture_tokens_per_s"], given["train_tokens_per_s"]) == (5.0, 7.0)


def test_the_watermarks_batch_tokens_and_wait_timeout_are_set_from_the_steps_config(tmp_path):
    """``stream.high_water``, ``low_water``, ``batch_tokens`` and ``wait_timeout_s`` reach the trainer's
    spool settings (and so the plan the producers follow); marks the wrong way round are refused naming them."""
    from eagle3_assets.drafter.stream_jobs import stream_settings_for
    from eagle3_assets.paths import DataLayout

    recipe = SimpleNamespace(name="r", datasets={"a": 1.0}, shape=SimpleNamespace(aux_layer_ids=None))
    stream = StreamingConfig(cap_bytes=1 << 30, high_water=0.8, low_water=0.5, batch_tokens=1024, wait_timeout_s=600.0)
    got = stream_settings_for(DataLayout(tmp_path), recipe, stream)
    assert (got.high_water, got.low_water, got.batch_tokens, got.wait_timeout_s) == (0.8, 0.5, 1024, 600.0)
    assert stream_settings_for(DataLayout(tmp_path), recipe, StreamingConfig(cap_bytes=1)).wait_timeout_s is None
    with pytest.raises(Exception, match="'low_water' .* must not exceed 'high_water'"):
        stream_settings_for(DataLayout(tmp_path), recipe, StreamingConfig(cap_bytes=1, high_water=0.5, low_water=0.6))
