"""Agentic datasets through the graph on kimi-mini: prompts -> raw_responses -> token_ids -> merged_corpus.

A glaive-format file, a ShareGPT tool file and an OpenAI tool file, each answered half by the
SGLang loopback (tools rendered into the ids by the target's template; the reply's ids carry the
tool-call section) and half by the OpenRouter loopback (``tools`` sent with ``require_parameters``;
structured ``tool_calls`` back, billed as usual), both serving kimi-mini. Token rows rebuild the
text-only tool-call replies with the chat template; the native ones calibrate that rebuilding.
"""

import json

import dagster as dg
import polars as pl
import pytest

from eagle3_assets.corpus.inventory import read_inventory
from eagle3_assets.generation.response_store import ResponseStore
from eagle3_assets.loopback import ModelGenerator, OpenRouterApp, SGLangApp, serve_in_thread
from eagle3_assets.prompts.options import ColumnMap, ReadOptions
from eagle3_assets.prompts.table import read_prompt_table
from eagle3_assets.resources import DatasetSettings, OpenRouterResource, SGLangResource, TargetResource
from eagle3_assets.target.embedded import EmbeddedModel
from eagle3_assets.target.tokenizer import TargetTokenizer
from tests.conftest import write_jsonl
from tests.support.dagster_helpers import checks_by_name, run_dataset, small_run_config

pytestmark = pytest.mark.model
TOOL_CALL_AGREEMENT = 0.95  # the bound under the measured 0.954-0.957 (docs/checks.md)
KEY = "sk-or-tools-0123456789"
IM_END, SECTION_BEGIN = 163586, 163595
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
                                                           "days": {"type": "integer"}}, "required": ["city"]}}
RATE = {"name": "convert_currency", "description": "Convert an amount",
        "parameters": {"type": "object", "properties": {"amount": {"type": "number"},
                                                        "to": {"type": "string", "enum": ["EUR", "USD"]}},
                       "required": ["amount", "to"]}}
SYSTEM = ("SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -\n"
          + json.dumps(WEATHER, indent=4) + "\n\n" + json.dumps(RATE, indent=4))
CALL = "ASSISTANT: <functioncall> {\"name\": \"get_weather\", \"arguments\": '{\"city\": \"Lima\"}'} <|endoftext|>"


def glaive_rows() -> list[dict]:
    ask = [f"USER: What is the weather in {c}?" for c in ("Oslo", "Lima", "Kyiv", "Rome")]
    return [
        {"system": SYSTEM, "chat": ask[0]},
        {"system": SYSTEM, "chat": f"{ask[1]}\n\n\n{CALL}\n\n\nFUNCTION RESPONSE: {{\"sky\": \"fog\"}}\n\n\n"
                                   "ASSISTANT: Foggy in Lima. <|endoftext|>"},
        {"system": SYSTEM, "chat": "USER: Convert 10 dollars to euros."},
        {"system": "SYSTEM: You are a helpful assistant, with no access to external functions.",
         "chat": "USER: Tell me a joke.\n\n\nASSISTANT: No. <|endoftext|>"},
        {"system": SYSTEM, "chat": f"{ask[2]}\n\n\n{CALL}\n\n\nFUNCTION RESPONSE: {{\"sky\": \"sun\"}}\n\n\n"
                                   f"ASSISTANT: Sunny. <|endoftext|>\n\n\n{ask[3]}"},
        {"system": SYSTEM, "chat": "USER: Convert 5 euros to dollars."},
    ]


def sharegpt_rows() -> list[dict]:
    tools = json.dumps([WEATHER, RATE])
    call = {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Bern"}})}
    return [{"id": f"sg{i}", "tools": tools, "conversations": conv} for i, conv in enumerate([
        [{"from": "human", "value": "Weather in Bern?"}],
        [{"from": "human", "value": "Weather in Bern?"}, call, {"from": "observation", "value": "rain"}],
        [{"from": "human", "value": "Convert 3 USD to EUR"}],
        [{"from": "human", "value": "Weather in Bern?"}, call, {"from": "observation", "value": "rain"},
         {"from": "gpt", "value": "Rain."}, {"from": "human", "value": "And tomorrow in Graz?"}],
    ])]


def openai_rows() -> list[dict]:
    tools = [{"type": "function", "function": WEATHER}, {"type": "function", "function": RATE}]
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_7", "type": "function", "function": {"name": "convert_currency",
                                                          "arguments": '{"amount": 2, "to": "EUR"}'}}]}
    return [{"id": f"oa{i}", "tools": tools, "messages": msgs} for i, msgs in enumerate([
        [{"role": "user", "content": "Weather in Quito?"}],
        [{"role": "user", "content": "2 USD in EUR?"}, call, {"role": "tool", "tool_call_id": "call_7", "content": "1.8"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Convert 7 EUR to USD"}],
        [{"role": "user", "content": "2 USD in EUR?"}, call, {"role": "tool", "tool_call_id": "call_7", "content": "1.8"},
         {"role": "assistant", "content": "1.8 EUR."}, {"role": "user", "content": "Weather in Lyon?"}],
    ])]


FILES = {  # dataset -> (rows, how the file is read)
    "b1_glaive": (glaive_rows, ReadOptions(final_assistant="drop")),
    "sharegpt_tools": (sharegpt_rows, ReadOptions(columns=ColumnMap(tools="tools"))),
    "openai_tools": (openai_rows, ReadOptions()),
}


@pytest.fixture(scope="module")
def servers(kimi_mini_dir):
    tok = TargetTokenizer.load(kimi_mini_dir, trust_remote_code=True)
    model = EmbeddedModel(kimi_mini_dir, tokenizer=tok)  # one model; a generator per server (each has its loop)
    with serve_in_thread(SGLangApp(ModelGenerator(model))) as sgl, \
            serve_in_thread(OpenRouterApp(ModelGenerator(model), api_key=KEY)) as orr:
        yield sgl, orr, model


@pytest.mark.parametrize("dataset", list(FILES))
def test_agentic_file_through_the_graph(layout, servers, dataset):
    sgl, orr, model = servers
    tok = model.target_tokenizer
    make, options = FILES[dataset]
    rows = make()
    write_jsonl(layout.prompt_source(dataset), rows)
    if not options.is_default:
        options.save(layout.prompt_read_options(dataset))
    billed_before = orr.stats()["billed_usd"]
    res = {"target": TargetResource(model="kimi-mini"), "sglang": SGLangResource(base_urls=[sgl.url]),
           "openrouter": OpenRouterResource(api_key=KEY, base_url=orr.url + "/api/v1", reasoning={"enabled": True}),
           # the stand-in's random weights write odd BPE paths: its text rows are calibrated, not gated
           "dataset_settings": DatasetSettings(consistency_threshold=0.5)}
    with dg.instance_for_test() as instance:
        first = run_dataset(instance, dataset, resources=res, selection=["prompts", "raw_responses"],
                            run_config=small_run_config(backend="sglang", max_samples=len(rows) // 2, max_new_tokens=24))
        assert first.success
        result = run_dataset(instance, dataset, resources=res,
                             run_config=small_run_config(backend="openrouter", max_new_tokens=24, concurrency=4))
        assert result.success, [e.message for e in result.all_events if e.event_type_value == "STEP_FAILURE"]

    meta = result.asset_materializations_for_node("prompts")[0].metadata
    assert meta["rows"].value == len(rows) and meta["rows_with_tools"].value >= len(rows) - 1
    assert meta["tool_calls"].value >= 1 and meta["tool_result_turns"].value >= 1

    responses = ResponseStore(layout.responses_dir(dataset)).rows()
    prompts_by_id = {p.prompt_id: p for p in read_prompt_table(layout.prompt_table(dataset))}
    assert sorted(r["source"] for r in responses) == ["openrouter"] * (len(rows) - len(rows) // 2) + \
        ["sglang"] * (len(rows) // 2)
    called = {r["source"]: 0 for r in responses}
    for r in responses:
        if r["tool_calls"]:
            called[r["source"]] += 1
            assert r["finish_reason"] == "stop" and "tool_call_reply" in r["flags"]
            for c in r["tool_calls"]:
                assert c["id"].startswith(f"functions.{c['function']['name']}:") and json.loads(c["function"]["arguments"])
            if r["source"] == "openrouter":
                assert r["native_finish_reason"] == "tool_calls" and r["output_ids"] is None
        elif "tools_sent" in r["flags"]:  # answered in text: counted when the user's turn was last
            assert ("tools_unused" in r["flags"]) == (prompts_by_id[r["prompt_id"]].messages[-1]["role"] == "user")
    assert called["sglang"] >= 1 and called["openrouter"] >= 1, called
    assert abs(sum(r["cost_usd"] for r in responses) - (orr.stats()["billed_usd"] - billed_before)) < 1e-12

    tokens = pl.read_parquet(layout.tokens(dataset))
    for t in tokens.filter(pl.col("tool_calls") > 0).iter_rows(named=True):
        completion = t["input_ids"][t["prompt_len"]:]
        assert SECTION_BEGIN in completion and completion[-1] == IM_END
        assert t["loss_mask"] == [0] * t["prompt_len"] + [1] * len(completion)
        assert t["built_from"] == ("native" if t["source"] == "sglang" else "retokenized")
        assert "functions." in tok.decode(completion)
    check = checks_by_name(result)["reconstruction_consistency"]
    assert check.passed, check.description
    assert check.metadata["tool_call_native_rows"].value == called["sglang"]
    assert check.metadata["tool_call_rebuilt_rows"].value == called["openrouter"]
    # the loopback's calls are the ones it wrote (names, ids, argument ids), never read back with the
    # project's KimiFormat.split; the project's template rendering of them against the ids the server
    # sent measured 0.9545 (b1_glaive), 0.9565 (sharegpt_tools) and 0.9540 (openai_tools): the
    # argument strings spelled with the model's own ids are the part a re-rendering cannot reproduce
    agreement = check.metadata["tool_call_token_agreement"].value
    print(f"{dataset}: tool-call token agreement {agreement!r}")
    assert TOOL_CALL_AGREEMENT <= agreement < 1, agreement

    inventory = {r["source"]: r for r in read_inventory(layout.metadata_db, dataset).to_dicts()}
    assert inventory["all"]["tool_call_responses"] == sum(called.values())
    assert inventory["sglang"]["tool_call_native_rows"] == called["sglang"]
    assert inventory["sglang"]["tool_call_agreement"] == pytest.approx(check.metadata["tool_call_token_agreement"].value)

    corpus = pl.read_parquet(layout.corpus(dataset))
    assert corpus.height == len(rows) and corpus.filter(pl.col("tool_calls") > 0).height == sum(called.values())


def test_a_provider_that_drops_tools_is_counted_and_require_parameters_avoids_it(layout, servers):
    gen = ModelGenerator(servers[2])
    write_jsonl(layout.prompt_source("dropped"), openai_rows()[:1] + openai_rows()[2:3])
    with serve_in_thread(OpenRouterApp(gen, api_key=KEY, drops_tools=True)) as orr, dg.instance_for_test() as instance:
        for routing in ({"require_parameters": False}, {}):
            res = {"target": TargetResource(model="kimi-mini"),
                   "openrouter": OpenRouterResource(api_key=KEY, base_url=orr.url + "/api/v1", provider=routing)}
            result = run_dataset(instance, "dropped", resources=res, selection=["prompts", "raw_responses"],
                                 run_config=small_run_config(backend="openrouter", max_new_tokens=8))
            assert result.success
            meta = result.asset_materializations_for_node("raw_responses")[0].metadata
            logged = " ".join(e.user_message for e in instance.all_logs(result.run_id))
            if routing:  # routed to a provider that dropped the tools: not one call, and it says so
                assert meta["new_replies_without_a_call_despite_tools"].value == 2
                assert "2 replies to prompts with tools called no tool although the user's turn was last" in logged
                assert "not one call: a backend that ignores `tools` looks like this" in logged
                ResponseStore(layout.responses_dir("dropped")).path("openrouter").unlink()
            else:  # require_parameters (the default with tools): a provider that takes them
                assert meta["new_tool_call_replies"].value == 2
