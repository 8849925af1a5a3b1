"""One dataset through the asset with three backends in turn: local, SGLang, OpenRouter (loopback)."""

import dagster as dg
import polars as pl
import pytest

from eagle3_assets.generation.response_store import ResponseStore
from eagle3_assets.loopback import ModelGenerator, OpenRouterApp, SGLangApp, serve_in_thread
from eagle3_assets.resources import OpenRouterResource, SGLangResource
from tests.conftest import small_prompts, write_jsonl
from tests.support.dagster_helpers import checks_by_name, run_dataset, small_run_config

pytestmark = pytest.mark.model
KEY = "sk-or-test-0123456789abcdef"


def test_local_then_sglang_then_openrouter_each_sample_once(layout, embedded, caplog):
    write_jsonl(layout.prompt_source("mixed"), small_prompts(6))
    with serve_in_thread(SGLangApp(ModelGenerator(embedded))) as sgl, \
            serve_in_thread(OpenRouterApp(ModelGenerator(embedded), api_key=KEY)) as orr, \
            dg.instance_for_test() as instance:
        http = {"sglang": SGLangResource(base_urls=[sgl.url]),
                "openrouter": OpenRouterResource(api_key=KEY, base_url=orr.url + "/api/v1")}
        gen = ["prompts", "raw_responses"]
        assert run_dataset(instance, "mixed", resources=http, selection=gen,
                           run_config=small_run_config(max_samples=2)).success
        assert run_dataset(instance, "mixed", resources=http, selection=gen,
                           run_config=small_run_config(backend="sglang", max_samples=2, concurrency=2)).success
        result = run_dataset(instance, "mixed", resources=http,
                             run_config=small_run_config(backend="openrouter", concurrency=2))
        assert result.success

        rows = ResponseStore(layout.responses_dir("mixed")).rows()
        assert len(rows) == len({r["sample_id"] for r in rows}) == 6
        assert sorted(r["source"] for r in rows) == ["local"] * 2 + ["openrouter"] * 2 + ["sglang"] * 2
        billed = orr.stats()
        assert abs(sum(r["cost_usd"] for r in rows) - billed["billed_usd"]) < 1e-12

        tokens = pl.read_parquet(layout.tokens("mixed"))
        assert dict(tokens.group_by("built_from").len().iter_rows()) == {"native": 4, "retokenized": 2}
        check = checks_by_name(result)["reconstruction_consistency"]
        assert check.passed and check.metadata["retokenized_rows"].value == 2
        corpus = pl.read_parquet(layout.corpus("mixed"))
        assert corpus.height == 6
        meta = result.asset_materializations_for_node("raw_responses")[0].metadata
        assert meta["total_cost_usd"].value == pytest.approx(billed["billed_usd"])
        logged = caplog.text + str({k: v.value for k, v in meta.items()})
        assert KEY not in logged
