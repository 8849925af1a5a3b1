"""``drafter_checkpoint``'s ``stream`` config as the producers get it: the capture engine's job
settings through its extract role, refusals naming the setting, and the interpreter a user names
reaching the command each launcher runs."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import polars as pl
import pytest

from eagle3_assets.drafter.assets import StreamingConfig
from eagle3_assets.drafter.stream_run import longest_corpus, producer_settings
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
