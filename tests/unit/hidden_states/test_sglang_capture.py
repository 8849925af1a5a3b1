"""SGLang extraction without a GPU: the capture's pure parts against stand-in modules, and the
tensor-parallel job (torchrun, rank 0 writing) with a transformers-backed capture per rank.

The capture on SGLang 0.5.23's real ModelRunner (one CPU rank) is tests/integration/sglang/test_sglang_capture_real.py;
what only a GPU box or several ranks can prove is listed in
``eagle3_assets.engines.sglang.capture.UNVERIFIED``. Scale: Kimi-K2.5 runs this job
with 8 ranks (TP8), 16k-token batches and 61 layers; here 2 ranks, 30 layers, 6 short rows.
"""

import json
import os
import subprocess
import sys

import dagster as dg
import polars as pl
import pytest
import torch
from torch import nn

from eagle3_assets.engines.local.extractor import LocalExtractor
from eagle3_assets.engines.sglang.capture import (
    REQUIRED_SERVER_ARGS,
    CapturedStates,
    capture_server_args,
    replace_logits_processors,
    set_capture_layers,
)
from eagle3_assets.hidden_states.extract import extract_corpus, verify_shards
from eagle3_assets.hidden_states.reader import ShardReader
from eagle3_assets.hidden_states.sglang_extract import SGLangExtractionJob, main
from eagle3_assets.hidden_states.tensor_parallel import init_tensor_parallel
from eagle3_assets.paths import REPO_ROOT
from eagle3_assets.target.identity import target_identity
from eagle3_assets.target.ref import TargetRef
from tests.unit.hidden_states.test_hidden_states import make_corpus

# ---- the capture's pure parts -------------------------------------------------------------------


def test_server_args_fix_what_the_capture_needs():
    args = capture_server_args("/models/kimi", tp_size=8, max_tokens=16384, max_rows=64, trust_remote_code=True,
                               extra={"mem_fraction_static": 0.85})
    assert {k: args[k] for k in REQUIRED_SERVER_ARGS} == REQUIRED_SERVER_ARGS
    assert (args["tp_size"], args["max_total_tokens"], args["max_running_requests"]) == (8, 16384, 64)
    assert args["mem_fraction_static"] == 0.85 and args["skip_tokenizer_init"] and args["trust_remote_code"]
    with pytest.raises(ValueError, match="disable_radix_cache"):
        capture_server_args("m", tp_size=1, max_tokens=8, max_rows=1, extra={"disable_radix_cache": False})


class Decoder(nn.Module):
    """SGLang's decoder loop in miniature: index i in layers_to_capture keeps the stream entering layer i."""

    def __init__(self, n=8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(n))
        self.layers_to_capture = []

    def forward(self, x):
        aux = []
        for i, layer in enumerate(self.layers):
            if i in self.layers_to_capture:
                aux.append(x)
            x = torch.tanh(layer(x))
        return x, aux


class LlamaLike(nn.Module):  # models/llama.py in 0.5.14: always +1
    def __init__(self):
        super().__init__()
        self.model = Decoder()

    def set_eagle3_layers_to_capture(self, ids):
        self.model.layers_to_capture = [i + 1 for i in ids]


class DeepseekLike(LlamaLike):  # models/deepseek_v2.py in 0.5.14: +1 only when ids[0] == 1
    def set_eagle3_layers_to_capture(self, ids):
        self.model.layers_to_capture = [i + 1 for i in ids] if ids[0] == 1 else list(ids)


class KimiLike(nn.Module):  # models/kimi_k25.py: delegates to its language model
    def __init__(self):
        super().__init__()
        self.language_model = DeepseekLike()

    def set_eagle3_layers_to_capture(self, ids):
        self.language_model.set_eagle3_layers_to_capture(ids)


@pytest.mark.parametrize("family", [LlamaLike, DeepseekLike, KimiLike])
@pytest.mark.parametrize("ids", [[1, 3, 5], [2, 3, 5], [0, 4, 6]])
def test_capture_layers_are_layer_outputs_for_every_family(family, ids):
    model = family()
    assert set_capture_layers(model, ids) == [i + 1 for i in ids]
    decoder = next(m for m in model.modules() if isinstance(m, Decoder))
    x = torch.randn(3, 4)
    _, aux = decoder(x)
    outputs, h = [], x
    for layer in decoder.layers:
        h = torch.tanh(layer(h))
        outputs.append(h)
    for got, k in zip(aux, ids):
        assert torch.equal(got, outputs[k])  # the output of decoder layer k, not k - 1
    with pytest.raises(RuntimeError, match="no set_eagle3_layers_to_capture"):
        set_capture_layers(Decoder(), ids)


class FakeLogitsProcessor(nn.Module):
    def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None):
        return hidden_states @ lm_head.T  # what must no longer run


def test_capture_head_replaces_every_logits_processor():
    model = nn.Module()
    model.language_model = nn.Module()
    model.language_model.logits_processor = FakeLogitsProcessor()
    assert replace_logits_processors(model, FakeLogitsProcessor) == 1
    head = model.language_model.logits_processor
    last, aux = torch.randn(5, 4), [torch.randn(5, 4) for _ in range(3)]
    out = head(torch.arange(5), last, torch.randn(100, 4), object(), aux)
    assert isinstance(out, CapturedStates) and out.next_token_logits is None
    assert torch.equal(out.aux, torch.cat(aux, -1)) and out.last is last
    with pytest.raises(RuntimeError, match="no aux hidden states"):
        head(torch.arange(5), last, None, object(), None)
    with pytest.raises(RuntimeError, match="no FakeLogitsProcessor"):
        replace_logits_processors(nn.Linear(2, 2), FakeLogitsProcessor)


def test_sglang_capture_drives_the_runner_as_sglang_expects(monkeypatch):
    """SGLangCapture against stand-ins for the sglang names it imports (0.5.23 signatures): a second
    rank's placement is published before the runner is built (the real runner on one CPU rank is
    tests/integration/sglang/test_sglang_capture_real.py), and the pools are freed after a failed forward."""
    from eagle3_assets.engines.sglang.capture import SGLangCapture
    from tests.support import fake_sglang

    fake_sglang.install(monkeypatch)
    cap = SGLangCapture("/models/tiny", layer_ids=[0, 2, 3], tp_rank=1, tp_size=2, gpu_id=1, batch_tokens=64,
                        longest_row=3, max_rows=4, server_args={"mem_fraction_static": 0.8})
    (_, server), (_, runner) = fake_sglang.CALLS
    assert server["disable_radix_cache"] and server["chunked_prefill_size"] == -1 and server["mem_fraction_static"] == 0.8
    assert cap.pool_tokens == 64 and cap.runner.max_total_num_tokens == 64
    assert runner == {"world_rank": 1, "gpu_id": 1, "parallel": ["init_parallel_runtime", "init_layer_runtime"]}
    assert cap.runner.setup == ["alloc_memory_pool", "init_attention_backends", "init_cuda_graphs"]
    assert cap.layers_to_capture == [1, 3, 4]

    rows = [[5, 6, 7], [8, 9], [10]]
    aux, last = cap.capture(rows)
    decoder = cap.runner.model.model
    hidden, states = torch.zeros(0, 8), []
    for row in rows:  # each row alone, through the same miniature decoder
        with torch.no_grad():
            h, a = decoder(torch.tensor(row))
        hidden, states = torch.cat([hidden, h]), states + [torch.cat(a, -1)]
    assert aux.shape == (6, 24) and last.shape == (6, 8)
    torch.testing.assert_close(aux, torch.cat(states), rtol=1e-5, atol=1e-6)  # row-wise kernels may round apart
    torch.testing.assert_close(last, hidden, rtol=1e-5, atol=1e-6)
    assert cap.runner.req_to_token_pool.cleared == cap.runner.token_to_kv_pool_allocator.cleared == 1
    cap.runner.fail_next = True
    with pytest.raises(RuntimeError, match="out of memory"):
        cap.capture(rows)
    assert cap.runner.req_to_token_pool.cleared == 2  # the pools are freed on failure too


# ---- the KV pool and batches sized for real rows (a Kimi-K2.5 reply runs to tens of thousands of tokens) -----


def test_pool_is_sized_from_the_longest_row_in_whole_pages():
    from eagle3_assets.engines.sglang.capture import kv_pool_tokens

    assert kv_pool_tokens(longest_row=900, batch_tokens=4096, page_size=1) == 4096  # the batch budget
    assert kv_pool_tokens(longest_row=30_000, batch_tokens=4096, page_size=1) == 30_000  # a long row alone
    assert kv_pool_tokens(longest_row=30_001, batch_tokens=4096, page_size=64) == 30_016  # trtllm_mla pages
    assert kv_pool_tokens(longest_row=10, batch_tokens=100, page_size=64) == 128  # the pool is whole pages


def test_batches_count_whole_pages():
    from eagle3_assets.hidden_states.extract import plan_batches

    lengths = [65, 65, 65, 64, 64, 64, 64]
    assert plan_batches(lengths, 256) == [[0, 1, 2], [3, 4, 5, 6]]  # 3 x 65 = 195 tokens fit
    assert plan_batches(lengths, 256, page_size=64) == [[0, 1], [2, 3], [4, 5, 6]]  # a 65-token row takes 128


@pytest.mark.parametrize("flag", ["enable_dp_attention", "enable_attn_tp_input_scattered", "enable_two_batch_overlap"])
def test_server_args_that_break_capture_are_refused(flag, monkeypatch):
    from eagle3_assets.engines.sglang.capture import SGLangCapture
    from tests.support import fake_sglang

    with pytest.raises(ValueError, match=f"{flag}: .*leave them off"):
        capture_server_args("m", tp_size=8, max_tokens=8, max_rows=1, extra={flag: True})
    fake_sglang.install(monkeypatch)
    monkeypatch.setattr(fake_sglang.ServerArgs, "RESOLVED", {flag: True})  # switched on by ServerArgs itself
    with pytest.raises(ValueError, match=f"resolved ServerArgs turn on .*{flag}"):
        SGLangCapture("/m", layer_ids=[1, 2, 3], tp_rank=0, tp_size=1, gpu_id=0, batch_tokens=64, longest_row=8,
                      max_rows=4)


def test_capture_sizes_its_pool_and_refuses_what_cannot_fit_before_a_batch(monkeypatch):
    from eagle3_assets.engines.sglang.capture import CapturePoolError, SGLangCapture
    from tests.support import fake_sglang

    fake_sglang.install(monkeypatch)
    kw = dict(layer_ids=[1, 2, 3], tp_rank=0, tp_size=1, gpu_id=0, batch_tokens=4096, max_rows=64)
    monkeypatch.setattr(fake_sglang.ServerArgs, "RESOLVED", {"page_size": 64})  # DeepSeek/Kimi on Blackwell
    cap = SGLangCapture("/m", longest_row=30_001, **kw)
    assert (cap.page_size, cap.pool_tokens, cap.runner.max_total_num_tokens) == (64, 30_016, 30_016)
    with pytest.raises(CapturePoolError, match="max_total_tokens 4096 cannot hold the longest row"):
        SGLangCapture("/m", longest_row=30_001, server_args={"max_total_tokens": 4096}, **kw)
    monkeypatch.setattr(fake_sglang.ModelRunner, "GPU_TOKENS", 20_000)  # what the GPUs leave for the pool
    with pytest.raises(CapturePoolError, match="KV pool holds 19968 tokens, but the longest row .*needs 30016"):
        SGLangCapture("/m", longest_row=30_001, **kw)


def test_an_sglang_other_than_the_supported_one_is_refused_before_the_capture_loads(monkeypatch):
    from types import SimpleNamespace

    from eagle3_assets.engines.sglang.capture import SGLangCapture
    from eagle3_assets.engines.versions import EngineVersionError
    from tests.support import fake_sglang

    fake_sglang.install(monkeypatch)
    k25 = SimpleNamespace(to_dict=lambda: {"model_type": "kimi_k25", "text_config": {"kv_lora_rank": 512}})
    monkeypatch.setattr(fake_sglang.ModelConfig, "hf_config", k25, raising=False)
    monkeypatch.setattr(sys.modules["sglang"], "__version__", "0.5.9")
    with pytest.raises(EngineVersionError, match=r"SGLang 0.5.9 in the capture's environment; this project supports "
                                                 r"SGLang 0\.5\.23"):
        SGLangCapture("/m", layer_ids=[1, 2, 3], tp_rank=0, tp_size=1, gpu_id=0, batch_tokens=64, longest_row=8,
                      max_rows=4)


def test_rows_over_the_context_are_quarantined_and_batches_use_the_capture_pages(tmp_path):
    """Rank 0's extractor plans with the capture's page size and never runs a row longer than the context."""
    from eagle3_assets.hidden_states.sglang_extract import SGLangExtractionJob, longest_row
    from eagle3_assets.hidden_states.tensor_parallel import Group, LeaderExtractor
    from tests.unit.hidden_states.test_hidden_states import Fake

    corpus = make_corpus(tmp_path / "corpus.parquet", lengths=[65, 65, 65, 64, 300])
    ran = []

    def capture(rows):
        ran.append([len(r) for r in rows])
        feats = Fake().extract(rows)
        return torch.cat([f.aux for f in feats]), torch.cat([f.last for f in feats])

    leader = LeaderExtractor(capture, Group(0, 1, 0, None), hidden_size=Fake.hidden_size, vocab_size=49152,
                             max_length=200, page_size=64, describe=Fake().describe())
    report = extract_corpus(corpus, tmp_path / "hs", leader, batch_tokens=256)
    assert ran == [[65, 65], [65, 64]] and report.quarantined_new == 1
    index = pl.read_parquet(tmp_path / "hs" / "index.parquet").filter(pl.col("quarantined"))
    assert index["sample_id"].to_list() == ["s04"] and "longer than the target's context (200)" in index["reason"][0]
    job = SGLangExtractionJob(target=TargetRef(model_dir="m"), corpus=str(corpus), out_dir="o", max_length=200)
    assert longest_row(job) == 65  # the pool is sized for what runs, not for the quarantined row


def test_job_errors_name_the_file_and_field(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "job.json"
    bad.write_text(json.dumps({"target": {"model_dir": "m"}, "corpus": "c", "out_dir": "o", "tp_size": 0}))
    assert main(["--config", str(bad)]) == 2
    assert f"{bad}: field 'tp_size'" in capsys.readouterr().err
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="torchrun --nproc-per-node=8"):
        init_tensor_parallel(8)


# ---- the tensor-parallel job under torchrun -------------------------------------------------------

pytest_model = pytest.mark.model


def _job(model_dir, corpus, out, **kw) -> SGLangExtractionJob:
    return SGLangExtractionJob(target=TargetRef(model_dir=str(model_dir), identity=target_identity(model_dir)),
                               corpus=str(corpus), out_dir=str(out), tp_size=2, batch_tokens=96, shard_bytes=300_000, **kw)


@pytest_model
def test_two_ranks_run_every_forward_and_rank_zero_writes_what_local_extraction_writes(model_dir, tmp_path):
    corpus = make_corpus(tmp_path / "corpus.parquet", lengths=[21, 9, 30, 14, 25, 7])
    out = tmp_path / "hs"
    job = tmp_path / "job.json"
    job.write_text(_job(model_dir, corpus, out).model_dump_json())
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "eagle3_assets.hidden_states.sglang_extract", "--config", str(job),
               "--capture", "tests.support.capture:local_capture"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]

    assert verify_shards(out, corpus).ok
    ranks = [(tmp_path / f"hs.rank{r}.jsonl").read_text().splitlines() for r in range(2)]
    assert ranks[0] == ranks[1] == ["[30, 25, 21]", "[14, 9, 7]"]  # same batches, same order, on both ranks
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["backend"] == "tests.support.capture:local_capture tp2"
    assert manifest["layers"]["aux_layer_ids"] == [1, 14, 26]
    report = json.loads((out / "extraction-report.json").read_text())
    assert report["extracted"] == 6 and report["batches"] == 2

    # Bit equality is the claim, so both sides run with the ranks' one thread: a matmul's reduction
    # order (and so its last bits) follows the thread count, which differs from machine to machine.
    local = tmp_path / "local"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        extract_corpus(corpus, local, LocalExtractor(model_dir), batch_tokens=96, shard_bytes=300_000)
    finally:
        torch.set_num_threads(threads)
    a, b = ShardReader(out), ShardReader(local)
    assert sorted(a.sample_ids()) == sorted(b.sample_ids())
    for sid in a.sample_ids():
        x, y = a.read(sid), b.read(sid)
        assert torch.equal(x.aux_hidden, y.aux_hidden) and torch.equal(x.last_hidden, y.last_hidden), sid


@pytest_model
def test_hidden_states_asset_sglang_backend_runs_torchrun_through_pipes(layout, model_dir, monkeypatch):
    from tests.conftest import small_prompts, write_jsonl
    from tests.support.dagster_helpers import checks_by_name, run_dataset, run_hidden_states

    monkeypatch.setenv("EAGLE3_SGLANG_CAPTURE", "tests.support.capture:local_capture")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    write_jsonl(layout.prompt_source("tp"), small_prompts(2))
    with dg.instance_for_test() as instance:
        assert run_dataset(instance, "tp").success
        result = run_hidden_states(instance, "tp", config={"backend": "sglang", "tp_size": 1})
        assert result.success, [e.message for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
        assert checks_by_name(result)["shard_integrity"].passed
        meta = result.asset_materializations_for_node("hidden_states")[0].metadata
        assert meta["extracted_now"].value == 2 and meta["tokens"].value > 0
    assert (layout.hidden_states_dir("tp").parent / "tp.rank0.jsonl").read_text()  # the launched capture ran
