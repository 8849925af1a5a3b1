"""The target's device and dtype reach every extraction backend; ``auto`` resolves per machine.

Before, the local backend always loaded the target in float32 (the asset never passed the target's
dtype), SGLang got its own ``auto`` and the jobs written for SLURM carried no model dtype at all.
The model's parameters are the record checked here, not a setting the code under test echoes.
"""

import json
from types import SimpleNamespace

import pytest
import torch

from eagle3_assets.hidden_states import extract_job, sglang_extract
from eagle3_assets.hidden_states.assets import HiddenStatesConfig, build_extractor
from eagle3_assets.hidden_states.launch import extraction_launch
from eagle3_assets.hidden_states.sglang_launch import write_sglang_job
from eagle3_assets.hidden_states.tensor_parallel import Group
from eagle3_assets.resources import SlurmResource, TargetResource, VLLMResource
from eagle3_assets.target import precision
from tests.unit.hidden_states.test_hidden_states import make_corpus


def param_dtypes(extractor) -> set:
    return {p.dtype for p in extractor.model.parameters()}


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(precision, "cuda_available", lambda: False)


def test_auto_resolves_per_device(monkeypatch):
    monkeypatch.setattr(precision, "cuda_available", lambda: False)
    assert precision.resolve_device("auto") == "cpu" and precision.resolve_dtype("auto") == "float32"
    monkeypatch.setattr(precision, "cuda_available", lambda: True)
    assert precision.resolve_device("auto") == "cuda" and precision.resolve_dtype("auto") == "bfloat16"
    assert precision.resolve_dtype("auto", "cpu") == "float32"  # a CPU run on a GPU box stays float32
    assert precision.resolve_dtype("auto", "cuda:1") == "bfloat16"
    assert [precision.resolve_dtype(d, "cpu") for d in ("bf16", "fp32", "fp16", "float32")] == \
        ["bfloat16", "float32", "float16", "float32"]
    with pytest.raises(ValueError, match="'int8' is not one of auto"):
        precision.resolve_dtype("int8")
    target = TargetResource()
    assert (target.device, target.dtype) == ("auto", "auto")
    assert target.torch_dtype("cpu") == "float32" and target.torch_dtype("cuda") == "bfloat16"


@pytest.mark.model
def test_local_extractor_takes_the_targets_dtype(model_dir, no_gpu):
    bf16 = build_extractor(HiddenStatesConfig(), TargetResource(dtype="bfloat16"))
    assert param_dtypes(bf16) == {torch.bfloat16} and bf16.device.type == "cpu"
    (feat,) = bf16.extract([list(range(5, 25))])
    assert feat.aux.dtype == feat.last.dtype == torch.bfloat16
    auto = build_extractor(HiddenStatesConfig(), TargetResource())  # auto on a machine without a GPU
    assert param_dtypes(auto) == {torch.float32}


@pytest.mark.model
def test_slurm_job_carries_the_targets_dtype_and_resolves_auto_on_the_node(model_dir, tmp_path, no_gpu):
    corpus = make_corpus(tmp_path / "corpus.parquet")
    target = TargetResource(dtype="bf16")
    launch = extraction_launch(HiddenStatesConfig(), target, SimpleNamespace(vllm=VLLMResource(), slurm=SlurmResource()),
                               corpus, tmp_path / "hs", "d", 1)
    job = extract_job.ExtractionJob.model_validate_json((tmp_path / ".hs.extract-job.json").read_text())
    assert launch.module == "eagle3_assets.hidden_states.extract_job"
    assert (job.model_dtype, job.device, job.dtype) == ("bf16", "auto", "bf16")  # shard storage is its own setting
    extractor = extract_job.build_extractor(job, None)
    assert param_dtypes(extractor) == {torch.bfloat16} and extractor.device.type == "cpu"


def test_vllm_job_server_gets_the_resolved_dtype(tmp_path, model_dir, monkeypatch, no_gpu):
    corpus = make_corpus(tmp_path / "corpus.parquet")
    cfg = HiddenStatesConfig(backend="vllm")
    resources = SimpleNamespace(vllm=VLLMResource(), slurm=SlurmResource(vllm_python="/usr/bin/python3"))
    extraction_launch(cfg, TargetResource(), resources, corpus, tmp_path / "hs", "d", 1)
    job = extract_job.ExtractionJob.model_validate_json((tmp_path / ".hs.extract-job.json").read_text())
    assert job.vllm.dtype == "auto" and job.vllm.enforce_eager is None  # resolved on the node, not here
    seen = {}

    class Recorder:
        def __init__(self, *args, **kw):
            seen.update(kw)
            raise RuntimeError("recorded")

    monkeypatch.setattr("eagle3_assets.engines.vllm.server.VLLMServer", Recorder)
    with pytest.raises(RuntimeError, match="recorded"):
        extract_job.build_extractor(job, None)
    assert seen["dtype"] == "float32" and seen["enforce_eager"] is True  # this node: no GPU
    monkeypatch.setattr(precision, "cuda_available", lambda: True)
    with pytest.raises(RuntimeError, match="recorded"):
        extract_job.build_extractor(job, None)
    assert seen["dtype"] == "bfloat16" and seen["enforce_eager"] is False


def test_sglang_job_carries_the_targets_dtype(tmp_path, model_dir, monkeypatch, no_gpu):
    corpus = make_corpus(tmp_path / "corpus.parquet")
    spec = TargetResource().spec()
    seen = {}

    class Recorder:
        def __init__(self, *args, **kw):
            seen.update(kw)

    monkeypatch.setattr("eagle3_assets.engines.sglang.capture.SGLangCapture", Recorder)
    for dtype, want in (("bfloat16", "bfloat16"), ("auto", "float32")):
        path = write_sglang_job(HiddenStatesConfig(backend="sglang"), spec, corpus, tmp_path / "hs", model_dtype=dtype)
        job = sglang_extract.SGLangExtractionJob.model_validate(json.loads(path.read_text()))
        assert job.model_dtype == dtype
        sglang_extract.engine_capture(job, Group(0, 1, 0, None), [1, 14, 26])
        assert seen["dtype"] == want
