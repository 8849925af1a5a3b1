"""The vLLM clients without a server: reply parsing, counters, the file protocol, layer mapping, launch
commands. The real engine is in ``test_vllm_serving.py`` and ``test_vllm_extraction.py``; these run
everywhere. Replies are shaped as vLLM 0.32.0 sends them (recorded from the real server).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import threading
import time

import httpx
import pytest
import torch

from eagle3_assets.engines.http.samples import SampleRequest, SamplingSettings
from eagle3_assets.engines.vllm.acceptance import acceptance_from_counters, compare, parse_prometheus
from eagle3_assets.engines.vllm.extractor import (
    VLLMExtractionError,
    features_from_file,
    rms_norm,
    vllm_layer_ids,
    wait_unlocked,
)
from eagle3_assets.engines.vllm.openai_ids import OpenAIIdsBackend
from eagle3_assets.engines.vllm.server import CPU_CONNECTOR, CPU_CONNECTOR_MODULE, PACKAGE_PARENT, VLLMServer

PROMPT = [1, 9690, 198, 2683, 359, 2, 198, 1, 4093, 198, 1780, 314, 216, 34, 27, 35, 47, 2, 198, 1, 520, 9531, 198]
OUTPUT = [34, 1232, 216, 35, 446, 216, 37, 2]


def chat_reply(**over) -> dict:
    c0 = {"index": 0, "message": {"role": "assistant", "content": "2 + 3 = 5", "reasoning": None},
          "finish_reason": "stop", "stop_reason": None, "token_ids": OUTPUT}
    reply = {"id": "chatcmpl-1", "object": "chat.completion", "model": "SmolLM2-135M-Instruct", "choices": [c0],
             "usage": {"prompt_tokens": len(PROMPT), "completion_tokens": len(OUTPUT), "total_tokens": 31},
             "prompt_token_ids": PROMPT, "kv_transfer_params": None}
    for k, v in over.items():
        (c0 if k in c0 else reply)[k] = v
    return reply


REQ = SampleRequest(sample_id="s0123abcd", dataset="d", prompt_id="p0", sample_index=0,
                    messages=[{"role": "user", "content": "What is 2+3?"}])
SAMPLING = SamplingSettings(target="t")


def _parse(backend, reply, status=200):
    prepared = backend.prepare(REQ, max_tokens=64, sampling=SAMPLING)
    return prepared, backend.parse(prepared, status, {}, json.dumps(reply).encode(), latency_s=0.5, attempts=1,
                                   base_url="http://h/v1")


def test_chat_reply_keeps_the_servers_ids():
    backend = OpenAIIdsBackend("http://h/v1", model="m", render_prompt=lambda m: list(PROMPT))
    prepared, parsed = _parse(backend, chat_reply())
    path, body = backend.request(prepared, 1)
    sent = json.loads(body)
    assert path == "/chat/completions" and sent["return_token_ids"] is True and sent["messages"] == REQ.messages
    assert parsed.outcome.ok and parsed.flags == ()
    row = parsed.row
    assert row["prompt_ids"] == PROMPT and row["output_ids"] == OUTPUT and row["source"] == "vllm"
    assert row["completion_tokens"] == len(OUTPUT) and row["finish_reason"] == "stop" and row["text"] == "2 + 3 = 5"


def test_prompt_rendered_differently_is_flagged_and_the_servers_ids_kept():
    backend = OpenAIIdsBackend("http://h/v1", model="m", render_prompt=lambda m: PROMPT[:-1])
    _, parsed = _parse(backend, chat_reply())
    assert parsed.outcome.ok and parsed.flags == ("prompt_differs_from_local",)
    assert parsed.row["prompt_ids"] == PROMPT  # what the completion was conditioned on


def test_completions_endpoint_sends_local_ids_and_refuses_an_echo_that_differs():
    backend = OpenAIIdsBackend("http://h/v1", model="m", render_prompt=lambda m: list(PROMPT), endpoint="completions")
    reply = chat_reply()
    reply["choices"][0].update(text="2 + 3 = 5", prompt_token_ids=PROMPT)
    del reply["choices"][0]["message"], reply["prompt_token_ids"]
    prepared, parsed = _parse(backend, reply)
    path, body = backend.request(prepared, 1)
    assert path == "/completions" and json.loads(body)["prompt"] == PROMPT
    assert parsed.outcome.ok and parsed.row["prompt_ids"] == PROMPT and parsed.row["text"] == "2 + 3 = 5"
    reply["choices"][0]["prompt_token_ids"] = PROMPT[1:]
    _, parsed = _parse(backend, reply)
    assert parsed.outcome.kind == "fail" and parsed.outcome.reason == "prompt_ids_mismatch"
    with pytest.raises(ValueError, match="render_prompt"):
        OpenAIIdsBackend("http://h/v1", endpoint="completions")


def test_text_only_and_inconsistent_replies_fail_the_sample():
    backend = OpenAIIdsBackend("http://h/v1", model="m")
    _, parsed = _parse(backend, chat_reply(token_ids=None, prompt_token_ids=None))
    assert parsed.outcome.kind == "fail" and parsed.outcome.reason == "no_token_ids"
    _, parsed = _parse(backend, chat_reply(usage={"prompt_tokens": 23, "completion_tokens": 9}))
    assert parsed.outcome.reason == "output_ids_mismatch"
    _, parsed = _parse(backend, chat_reply(finish_reason="length"))
    assert parsed.outcome.ok and parsed.row["finish_reason"] == "length"


def test_errors_are_classified_and_the_key_never_shows():
    backend = OpenAIIdsBackend("http://h/v1", model="m", api_key="sk-secret-123")
    assert "sk-secret-123" not in repr(backend)
    err = {"error": {"message": "bad key sk-secret-123", "type": "BadRequestError", "code": 400}}
    _, parsed = _parse(backend, err, status=400)
    assert parsed.outcome.kind == "fail" and "sk-secret-123" not in parsed.outcome.message
    _, parsed = _parse(backend, {"error": {"message": "overloaded"}}, status=503)
    assert parsed.outcome.kind == "retry"


def _mock_client(models: list[dict]):
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/models"
        return httpx.Response(200, json={"object": "list", "data": models})

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def _preflight(backend, models):
    async def go():
        async with _mock_client(models) as client:
            return await backend.preflight(client, backend.base_urls)

    return asyncio.run(go())


def test_preflight_resolves_the_served_model():
    one = [{"id": "SmolLM2-135M-Instruct", "max_model_len": 2048}]
    backend = OpenAIIdsBackend(["http://h/v1", "http://g/v1"], preferred_model="not-served")
    info, stop = _preflight(backend, one)
    assert stop is None and backend.model == "SmolLM2-135M-Instruct" == info["model"]
    two = [*one, {"id": "other"}]
    backend = OpenAIIdsBackend("http://h/v1", preferred_model="other")
    _preflight(backend, two)
    assert backend.model == "other"
    from eagle3_assets.generation.http_engine import BackendUnavailable

    with pytest.raises(BackendUnavailable, match="name the model"):
        _preflight(OpenAIIdsBackend("http://h/v1"), two)
    with pytest.raises(BackendUnavailable, match="served-model-name"):
        _preflight(OpenAIIdsBackend("http://h/v1", model="absent"), two)


METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 40.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 120.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 20.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 2.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_acceptance_from_prometheus_counters():
    before = parse_prometheus(METRICS)
    after = parse_prometheus(METRICS.replace(" 40.0", " 50.0").replace(" 120.0", " 150.0").replace(" 30.0", " 42.0")
                             .replace('"0"} 20.0', '"0"} 27.0').replace('"1"} 8.0', '"1"} 12.0')
                             .replace('"2"} 2.0', '"2"} 3.0'))
    assert "vllm:num_requests_running" not in before
    fig = acceptance_from_counters(before, after, k=3)
    assert fig["drafts"] == 10 and fig["draft_tokens"] == 30 and fig["accepted_tokens"] == 12
    assert fig["acceptance_length"] == pytest.approx(2.2)  # 1 + 12 / 10, SGLang's convention
    assert fig["per_position_rate"] == pytest.approx([0.7, 0.4, 0.1])
    from eagle3_assets.engines.roles import EngineAcceptance

    rep = EngineAcceptance(k=3, prompts=2, output_tokens=30, **fig)
    assert compare({"acceptance_length": 2.25, "per_position_rate": [0.7, 0.4, 0.15]}, rep)["difference"] == -0.05
    with pytest.raises(KeyError, match="speculative decoding"):
        acceptance_from_counters({}, {}, k=3)


def test_layer_mapping_and_final_norm(model_dir):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from eagle3_assets.engines.vllm.extractor import read_final_norm

    assert vllm_layer_ids([1, 14, 26], 30) == [2, 15, 27, 30]  # ours + 1, then the last layer (pre-norm)
    weight, eps = read_final_norm(model_dir)
    assert weight.shape == (576,) and weight.dtype == torch.float32 and eps == pytest.approx(1e-5)
    ref = LlamaRMSNorm(576, eps=eps)
    ref.weight.data.copy_(weight)
    x = torch.randn(5, 576) * 30
    assert torch.allclose(rms_norm(x, weight, eps), ref(x), rtol=1e-5, atol=1e-5)


def _write_connector_file(path, ids, states):
    from safetensors.torch import save_file

    save_file({"hidden_states": states, "token_ids": torch.tensor(ids, dtype=torch.long)}, str(path))


def test_the_lock_protocol_and_the_file_layout(tmp_path):
    path = tmp_path / "req-1.safetensors"
    lock = tmp_path / "req-1.safetensors.lock"
    fd = os.open(lock, os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the server holds it before it answers
    ids = [5, 6, 7]
    states = torch.randn(3, 4, 8)

    def writer():
        time.sleep(0.3)
        _write_connector_file(path, ids, states)
        os.close(fd)  # releases the lock once the file is complete

    t = threading.Thread(target=writer)
    t.start()
    wait_unlocked(path, timeout_s=600)
    done_when_released = not t.is_alive() or path.exists()
    t.join()
    assert done_when_released
    feat = features_from_file(path, ids, 3, torch.ones(8), 1e-6)
    assert torch.equal(feat.aux, states[:, :3].reshape(3, 24))  # aux layers side by side, ascending ids
    assert torch.allclose(feat.last, rms_norm(states[:, 3], torch.ones(8), 1e-6))
    with pytest.raises(VLLMExtractionError, match="differ"):
        features_from_file(path, [5, 6, 8], 3, torch.ones(8), 1e-6)
    _write_connector_file(path, ids, states[:, :3].contiguous())
    with pytest.raises(VLLMExtractionError, match="last layer"):
        features_from_file(path, ids, 3, torch.ones(8), 1e-6)
    # a file whose writer still holds the lock is never read
    fd = os.open(lock, os.O_WRONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(VLLMExtractionError, match="did not finish"):
            wait_unlocked(path, timeout_s=0.2)
    finally:
        os.close(fd)


def test_launch_commands(tmp_path, model_dir):
    ext = VLLMServer(model_dir, role="extract", vllm_layer_ids=[2, 15, 27, 30], connector="cpu", python="/x/python",
                     storage_dir=tmp_path / "hs", port=8123, workdir=tmp_path)
    cmd = ext.command()
    assert cmd[:3] == ["/x/python", "-m", "vllm.entrypoints.openai.api_server"] and "--enforce-eager" in cmd
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27, 30]
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == CPU_CONNECTOR and kv["kv_connector_module_path"] == CPU_CONNECTOR_MODULE
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path / "hs")
    assert "--no-enable-chunked-prefill" in cmd and "--disable-log-stats" not in cmd
    assert "--attention-backend" not in cmd  # chosen for MLA targets only (cpu_mla_args)
    env = ext.environment()
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(PACKAGE_PARENT)
    assert env["TMPDIR"].startswith(str(tmp_path)) and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    stock = VLLMServer(model_dir, role="extract", vllm_layer_ids=[2, 15, 27, 30], connector="stock", python="/x/p")
    kv = json.loads(stock.command()[stock.command().index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "ExampleHiddenStatesConnector" and "kv_connector_module_path" not in kv
    sp = VLLMServer(model_dir, role="speculate", drafter_dir=tmp_path / "d", num_speculative_tokens=4, python="/x/p")
    cfg = json.loads(sp.command()[sp.command().index("--speculative-config") + 1])
    assert cfg == {"method": "eagle3", "model": str(tmp_path / "d"), "num_speculative_tokens": 4}
    with pytest.raises(ValueError, match="drafter_dir"):
        VLLMServer(model_dir, role="speculate")
    from eagle3_assets.engines.vllm.server import VLLMServerError

    with pytest.raises(VLLMServerError, match="make vllm"):
        VLLMServer(model_dir, python=str(tmp_path / "absent" / "python")).start()
