"""Tools through a real vLLM serving kimi-mini: ``--enable-auto-tool-choice --tool-call-parser kimi_k2``.

Two questions a Kimi-K2.5 run asks of vLLM, on the stand-in:
- does vLLM's own ``kimi_k2`` parser read the tool-call section as kimi-mini's tokenizer decodes
  it (the ids the template writes for a call)? Asked of the parser in the vLLM environment itself;
- does a tool dataset go through ``raw_responses`` with ``backend: vllm`` (tools sent, the server
  rendering them through the tokenizer's own ``apply_chat_template`` override, so its prompt ids
  equal the local TypeScript-declaring rendering), ``token_ids`` and ``merged_corpus``, with every
  reply stopped at ``<|im_end|>`` although the config's ``eos_token_id`` is ``[EOS]``?
The stand-in's random weights never choose to call a tool, so the served replies are text: every
one is counted as ``tools_unused``, which is what the run must report. Nor do they ever end a turn,
so vLLM serves a copy whose ``<|im_end|>`` output row makes the first reply end after four tokens
(``ending_model``): the end-of-turn stop is then seen, not assumed.
"""

from __future__ import annotations

import json
import subprocess

import dagster as dg
import polars as pl
import pytest

from eagle3_assets.engines.vllm.server import VLLMServer, default_python, vllm_available
from tests.conftest import write_jsonl

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.model,
    pytest.mark.skipif(not vllm_available(), reason="no vLLM environment (.venv-vllm): run `make vllm` to run these"),
    pytest.mark.usefixtures("one_torch_thread"),
]
IM_END = 163586
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "properties": {"city": {"type": "string"}}}}}]
PARSE = """
import json, sys
from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers.kimi_k2_tool_parser import KimiK2ToolParser
tok = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)
ids, tools = json.loads(sys.argv[2]), json.loads(sys.argv[3])
parser = KimiK2ToolParser(tok)
req = parser.adjust_request(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=tools))
out = {}
for spaces in (False, True):  # as vLLM's detokenizer writes it, with and without spaces around added tokens
    info = parser.extract_tool_calls(tok.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=spaces), req)
    out[str(spaces)] = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in info.tool_calls]
print(json.dumps(out))
"""


def test_vllms_kimi_k2_parser_reads_the_stand_ins_tool_calls(kimi_mini_dir):
    from eagle3_assets.target.tokenizer import TargetTokenizer

    tok = TargetTokenizer.load(kimi_mini_dir, trust_remote_code=True)
    msgs = [{"role": "user", "content": "Weather in Paris and Oslo?"}]
    calls = [{"id": f"functions.get_weather:{i}", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}} for i, c in enumerate(["Paris", "Oslo"])]
    full = tok.tokenizer.apply_chat_template([*msgs, {"role": "assistant", "content": "", "tool_calls": calls}],
                                             tools=TOOLS, tokenize=True, add_generation_prompt=False, return_dict=True)
    reply = list(full["input_ids"])[len(tok.render_prompt(msgs, TOOLS)):]  # the ids the model would emit
    out = subprocess.run([default_python(), "-c", PARSE, str(kimi_mini_dir), json.dumps(reply), json.dumps(TOOLS)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    parsed = json.loads(out.stdout.strip().splitlines()[-1])
    want = [{"id": c["id"], "name": "get_weather", "arguments": c["function"]["arguments"]} for c in calls]
    assert parsed == {"False": want, "True": want}
    assert tok.parse_tool_calls(reply) == calls  # the project's own reading of the same ids agrees


QUESTIONS = ["Weather in Paris?", "Is it cold in Oslo?", "Rain in Lima?"]


@pytest.fixture(scope="module")
def ending_model(kimi_mini_dir, tmp_path_factory):
    """kimi-mini that ends its greedy reply to the first question after four tokens, as a trained
    model ends its turn; the random stand-in itself never emits ``<|im_end|>`` (it repeats one token).
    ``<|im_end|>``'s output row becomes that token's row plus the direction that scores +1 on the
    lm_head input of the fifth step and -1 on the first four (solved exactly: 5 equations, 64
    unknowns); everything else (tokenizer, template, the other weights) is kimi-mini's."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from eagle3_assets.drafter.spec_decode import greedy_generate
    from eagle3_assets.target.embedded import EmbeddedModel
    from eagle3_assets.target.tokenizer import TargetTokenizer

    model = EmbeddedModel(kimi_mini_dir, tokenizer=TargetTokenizer.load(kimi_mini_dir, trust_remote_code=True))
    prompt = model.render_prompt([{"role": "user", "content": QUESTIONS[0]}], TOOLS)
    reply = greedy_generate(model.model, prompt, max_new_tokens=5, stop_ids=model.stop_ids)
    assert IM_END not in reply  # the stand-in as it is does not end its turn
    with torch.no_grad():
        out = model.model(torch.tensor([prompt + reply[:4]]), output_hidden_states=True)
    h = out.hidden_states[-1][0, len(prompt) - 1:].float()  # the lm_head inputs of steps 1..5
    direction = torch.linalg.pinv(h) @ torch.tensor([-1.0, -1.0, -1.0, -1.0, 1.0])
    out_dir = tmp_path_factory.mktemp("ending") / kimi_mini_dir.name
    shutil.copytree(kimi_mini_dir, out_dir)
    weights = load_file(str(out_dir / "model.safetensors"))
    head = weights["language_model.lm_head.weight"]
    head[IM_END] = head[reply[4]] + direction.to(head.dtype)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


@pytest.fixture(scope="module")
def tool_server(ending_model, tmp_path_factory):
    args = ["--trust-remote-code", "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k2"]
    with VLLMServer(ending_model, role="generate", extra_args=args, workdir=tmp_path_factory.mktemp("vllm-tools")) as srv:
        yield srv


def test_tool_dataset_through_vllm(tool_server, layout):
    from eagle3_assets.generation.response_store import ResponseStore
    from eagle3_assets.resources import DatasetSettings, TargetResource, VLLMResource
    from tests.support.dagster_helpers import checks_by_name, run_dataset, small_run_config

    rows = [{"id": f"t{i}", "tools": TOOLS, "messages": [{"role": "user", "content": q}]}
            for i, q in enumerate(QUESTIONS)]
    rows.append({"id": "t3", "tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather",
                                                                              "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}]})
    write_jsonl(layout.prompt_source("vllm_tools"), rows)
    res = {"target": TargetResource(model="kimi-mini"), "vllm": VLLMResource(base_urls=[tool_server.api_url]),
           "dataset_settings": DatasetSettings(consistency_threshold=0.5)}
    with dg.instance_for_test() as instance:
        result = run_dataset(instance, "vllm_tools", resources=res,
                             run_config=small_run_config(backend="vllm", max_new_tokens=32, concurrency=4))
        assert result.success, [e.message for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    responses = ResponseStore(layout.responses_dir("vllm_tools")).rows()
    assert len(responses) == 4
    for r in responses:
        assert "prompt_differs_from_local" not in r["flags"], "vLLM rendered the tools otherwise than the template's override"
        assert "tools_sent" in r["flags"]
        assert r["finish_reason"] in ("stop", "length"), r["finish_reason"]
    stopped = [r for r in responses if r["finish_reason"] == "stop"]
    assert any(r["prompt_id"] == "t0" for r in stopped), [r["finish_reason"] for r in responses]
    for r in stopped:  # stopped at <|im_end|> (the config's eos is [EOS]), kept once, at the end
        assert r["output_ids"][-1] == IM_END and IM_END not in r["output_ids"][:-1], r["output_ids"]
    for r in responses:
        if r["finish_reason"] == "length":
            assert IM_END not in r["output_ids"] and len(r["output_ids"]) == 32
    meta = result.asset_materializations_for_node("raw_responses")[0].metadata
    unused = [r for r in responses if "tools_unused" in r["flags"]]
    assert meta["new_replies_without_a_call_despite_tools"].value == len(unused)
    assert all(r["prompt_id"] != "t3" for r in unused)  # after a tool result a text answer is not counted
    assert len(unused) + meta["new_tool_call_replies"].value >= 3
    tokens = pl.read_parquet(layout.tokens("vllm_tools"))
    assert tokens["native_ids"].all() and tokens["has_tools"].all()
    assert checks_by_name(result)["special_tokens_valid"].passed
    # a reply that is only <|im_end|> has nothing to train on: the corpus drops it
    spoken = [r for r in responses if len(r["output_ids"]) > 1]
    assert pl.read_parquet(layout.corpus("vllm_tools")).height == len(spoken) >= 1
