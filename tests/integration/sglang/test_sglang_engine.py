"""SGLang's own engine, for real (tests marked sglang): a server from ``.venv-sglang`` (``make sglang``)
running SGLang's CPU engine on the real SmolLM2 target, reached by the project's ``sglang`` backend.

One server for the module (about 60-80 s to start on 2 idle cores); this process keeps one core.
"""

from __future__ import annotations

import os

import dagster as dg
import httpx
import polars as pl
import pytest

from eagle3_assets.engines.sglang.server import SGLangServer, check_supported, installed_version
from eagle3_assets.engines.sglang.versions import SGLANG_VERSION
from eagle3_assets.engines.versions import EngineVersionError
from eagle3_assets.generation.response_store import ResponseStore
from eagle3_assets.resources import SGLangResource
from tests.conftest import small_prompts, write_jsonl
from tests.support.dagster_helpers import run_dataset, small_run_config

pytestmark = [pytest.mark.sglang, pytest.mark.model]
MAX_NEW = 24


@pytest.fixture(scope="module")
def sglang_server(model_dir, one_torch_thread):
    with SGLangServer(model_dir) as server:
        yield server


def test_the_environment_holds_the_one_supported_version(tmp_path):
    from eagle3_assets.engines.sglang.server import default_python

    assert installed_version(default_python()) == SGLANG_VERSION == check_supported(default_python())
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 0.5.14\n")
    fake.chmod(0o755)
    with pytest.raises(EngineVersionError, match=f"SGLang 0.5.14 .* supports SGLang {SGLANG_VERSION}"):
        check_supported(str(fake))


def test_raw_responses_from_a_real_sglang_keep_its_exact_greedy_ids(layout, embedded, sglang_server):
    """The rows' output ids are the target's own greedy decoding of the prompt ids the project
    rendered, the stop token kept as SGLang returns it, and completion_tokens counts them. The prompt-
    prefix repair for older SGLang (sgl-project/sglang#10896) is off by default: 0.5.23 needs none, and
    a leaked prefix would fail these rows as output_ids_mismatch."""
    prompts = {p["id"]: p["messages"] for p in small_prompts(6)}
    write_jsonl(layout.prompt_source("sgl"), small_prompts(6))
    resource = SGLangResource(base_urls=[sglang_server.base_url])  # prefix repair off (the default)
    with dg.instance_for_test() as instance:
        result = run_dataset(instance, "sgl", resources={"sglang": resource},
                             selection=["prompts", "raw_responses", "token_ids"],
                             run_config=small_run_config(MAX_NEW, backend="sglang", concurrency=6))
        assert result.success
    rows = ResponseStore(layout.responses_dir("sgl")).rows()
    assert len(rows) == 6 and {r["source"] for r in rows} == {"sglang"}
    stops = set(embedded.stop_ids)
    greedy = embedded.generate([r["prompt_ids"] for r in rows], max_new_tokens=MAX_NEW)
    for row, want in zip(rows, greedy):
        assert row["prompt_ids"] == embedded.render_prompt(prompts[row["prompt_id"]])
        assert row["output_ids"] == want.output_ids, row["prompt_id"]
        assert row["completion_tokens"] == len(row["output_ids"])
        assert "prefix_repaired" not in row["flags"] and "completion_tokens_missing" not in row["flags"]
        if row["finish_reason"] == "stop":
            assert row["output_ids"][-1] in stops  # the stop token is kept in output_ids
    assert sum(r["finish_reason"] == "stop" for r in rows) >= 3  # these prompts end in a few tokens
    tokens = pl.read_parquet(layout.tokens("sgl"))
    assert tokens.height == 6 and set(tokens["built_from"]) == {"native"}


def test_the_server_refuses_hidden_states_it_was_not_started_for(sglang_server):
    """A capture over HTTP needs --enable-return-hidden-states; SGLang says so instead of ignoring it."""
    r = httpx.post(sglang_server.base_url + "/generate", timeout=300.0,
                   json={"input_ids": [1, 504, 3575, 282, 4649, 314], "return_hidden_states": True,
                         "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    assert r.status_code == 400 and "enable-return-hidden-states" in r.text.replace("_", "-")


CAPTURE_ARGS_PROBE = """
import json, msgspec
from sglang.srt.server_args import ServerArgs
from eagle3_assets.engines.sglang.capture import (BREAKS_CAPTURE, REQUIRED_SERVER_ARGS, breaking_args,
                                                        capture_server_args, kv_pool_tokens)
names = {{f.name for f in msgspec.structs.fields(ServerArgs)}}
kw = capture_server_args({model!r}, tp_size=1, max_tokens=kv_pool_tokens(300, 256), max_rows=4)
args = ServerArgs(**kw)
overlap = ServerArgs(**{{**kw, "enable_two_batch_overlap": True}})
print(json.dumps({{"unknown": sorted(k for k in [*REQUIRED_SERVER_ARGS, *BREAKS_CAPTURE, *kw] if k not in names),
                  "fixed": {{k: getattr(args, k) for k in REQUIRED_SERVER_ARGS}}, "pool": args.max_total_tokens,
                  "breaking": breaking_args(args), "overlap_breaking": breaking_args(overlap)}}))
"""


def test_the_capture_server_args_are_real_0_5_23_fields_and_its_refusals_read_them(model_dir):
    """Every setting the capture fixes or refuses is a field of SGLang's own ServerArgs (a msgspec
    struct in 0.5.23), the struct accepts the capture's arguments, the KV pool is the one planned
    for the longest row, and a breaking setting on the real struct is found."""
    import json
    import subprocess

    from eagle3_assets.engines.sglang.cpu import server_environment
    from eagle3_assets.engines.vllm.server import PACKAGE_PARENT

    server = SGLangServer(model_dir)  # its interpreter; never started
    env = server_environment()
    env["PYTHONPATH"] += os.pathsep + str(PACKAGE_PARENT)
    out = subprocess.run([server.python, "-c", CAPTURE_ARGS_PROBE.format(model=str(model_dir))], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["unknown"] == []
    assert got["fixed"] == {"enable_return_hidden_states": True, "disable_radix_cache": True,
                            "chunked_prefill_size": -1, "disable_cuda_graph": True, "pp_size": 1}
    assert got["pool"] == 300 and got["breaking"] == [] and got["overlap_breaking"] == ["enable_two_batch_overlap"]
