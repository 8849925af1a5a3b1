"""Engines behind one registry: every registered role keeps its protocol and lives in its engine's
folder, and an engine registered here, by its lines in ``ROLES`` only, reaches every stage it claims
(``raw_responses`` through its generate role, ``hidden_states`` through its extract role), taken by
the stages' typed config choices. The architecture page's steps for adding an engine name files
that exist."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import dagster as dg
import polars as pl
import pytest
import torch

import eagle3_assets.definitions  # noqa: F401  (the stages as imported, built before a test registers an engine)
from eagle3_assets.engines import ROLES, engine_names, engine_role
from eagle3_assets.engines.roles import Extract, Features, Generate, HttpGeneration, Serve, TensorParallelExtract

REPO = Path(__file__).resolve().parents[3]
PROTOCOLS = {"generate": Generate, "extract": Extract, "serve": Serve}


def test_every_registered_role_keeps_its_protocol_and_lives_in_its_engines_folder():
    assert {role for role, _ in ROLES} == set(PROTOCOLS)
    for (role, name), where in ROLES.items():
        module = where.partition(":")[0]
        assert module.startswith(f"eagle3_assets.engines.{name}."), (role, name, where)
        assert (REPO / "eagle3_assets" / "engines" / name).is_dir(), name
        assert isinstance(engine_role(role, name), PROTOCOLS[role]), (role, name)
        if role == "extract" and engine_role(role, name).tensor_parallel:
            assert isinstance(engine_role(role, name), TensorParallelExtract), name


def test_an_engine_without_a_role_is_refused_naming_those_with_it():
    with pytest.raises(ValueError, match=r"'openrouter' does not serve the 'extract' role.*'local', 'sglang', 'vllm'"):
        engine_role("extract", "openrouter")
    with pytest.raises(ValueError, match="unknown role 'train'"):
        engine_names("train")


def test_no_stage_names_an_engine_where_it_chooses_one():
    """The branches the registry replaced stay gone: no ``backend == "..."`` in the stages that ask it."""
    for path in ["generation/assets.py", "hidden_states/assets.py", "hidden_states/launch.py",
                 "hidden_states/extract_job.py"]:
        text = (REPO / "eagle3_assets" / path).read_text()
        assert not re.search(r"backend\s*(==|!=|in)\s*[\"'(]", text), path


# ---- a fake engine, registered here only --------------------------------------------------------

class EchoGenerate:
    """Generation through a loopback server speaking SGLang's API, under the engine name ``echo``."""

    in_process, exact_ids, gpu, resources = False, True, False, ()
    url = ""
    calls: list = []

    def http(self, resources, spec, tokenizer, concurrency):
        from eagle3_assets.engines.http.client import ClientConfig
        from eagle3_assets.engines.sglang.backend import SGLangBackend

        tok = tokenizer()
        self.calls.append(spec.name)
        backend = SGLangBackend([self.url], tok.render_prompt)
        backend.source = "echo"  # the rows name the engine that wrote them
        return HttpGeneration(backend, ClientConfig(), concurrency or 4)


H = 8


class EchoExtractor:
    """Deterministic states, a function of the ids: what the shards must hold, computed apart."""

    hidden_size, vocab_size = H, 49152

    def __init__(self, spec):
        self.spec = spec

    def describe(self):
        from eagle3_assets.target import layers as hidden_layers

        return {"target": self.spec.identity, "layers": hidden_layers.convention([1, 14, 26], 30), "backend": "echo"}

    def extract(self, rows):
        return [Features(*expected_states(r)) for r in rows]


def expected_states(ids):
    base = torch.tensor(ids, dtype=torch.float32).unsqueeze(1) / 49152
    return base * torch.linspace(-3, 3, 3 * H), base * torch.linspace(-1, 1, H)


class EchoExtract:
    in_step, tensor_parallel, resources = True, False, ()
    calls: list = []

    def step_extractor(self, spec, *, layer_ids, resources):
        self.calls.append(spec.name)
        return EchoExtractor(spec)

    def job_settings(self, config, target, resources, corpus, spec):
        return {}

    def job_extractor(self, job, stack):
        raise AssertionError("the local launcher extracts an in-step engine in the step")


ECHO_GENERATE, ECHO_EXTRACT = EchoGenerate(), EchoExtract()


def fresh(module: str):
    """A separate copy of a stage's asset module, built with the registry as it is now (its config's
    typed choice is made when the module runs); the imported module is left as it was."""
    spec = importlib.util.find_spec(module)
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    return copy


@pytest.fixture
def echo(monkeypatch):
    monkeypatch.setitem(ROLES, ("generate", "echo"), "tests.unit.engines.test_engines:ECHO_GENERATE")
    monkeypatch.setitem(ROLES, ("extract", "echo"), "tests.unit.engines.test_engines:ECHO_EXTRACT")
    EchoGenerate.calls.clear()
    EchoExtract.calls.clear()
    return ROLES


def test_a_registered_engine_generates_through_the_raw_responses_asset(layout, model_dir, echo):
    from eagle3_assets.definitions import default_resources
    from eagle3_assets.generation.assets import GenerationConfig
    from eagle3_assets.generation.response_store import ResponseStore
    from eagle3_assets.loopback import SGLangApp, SyntheticGenerator, serve_in_thread
    from eagle3_assets.partitions import datasets_partitions
    from eagle3_assets.prompts.assets import prompts
    from tests.conftest import small_prompts, write_jsonl

    with pytest.raises(Exception, match="'local'"):  # the stage as imported: "echo" is no choice of its config
        GenerationConfig(backend="echo")
    generation = fresh("eagle3_assets.generation.assets")  # built with the line registered: it is one
    assert "echo" in generation.BACKENDS and generation.GenerationConfig(backend="echo").backend == "echo"
    write_jsonl(layout.prompt_source("qa"), small_prompts(5))
    with serve_in_thread(SGLangApp(SyntheticGenerator())) as srv, dg.instance_for_test() as instance:
        ECHO_GENERATE.url = srv.url
        instance.add_dynamic_partitions(datasets_partitions.name, ["qa"])
        result = dg.materialize(
            [prompts, generation.raw_responses], partition_key="qa", instance=instance, resources=default_resources(),
            run_config={"ops": {"raw_responses": {"config": {"backend": "echo", "max_new_tokens": 8}}}})
        assert result.success
        served = srv.stats()["generations"]
    rows = ResponseStore(layout.responses_dir("qa")).rows()
    assert len(EchoGenerate.calls) == 1
    assert len(rows) == 5 and {r["source"] for r in rows} == {"echo"}
    assert (layout.responses_dir("qa") / "echo.jsonl").exists()
    assert served == 5  # the server's own count: every row was generated there, once


def test_a_registered_engine_extracts_through_the_hidden_states_asset(layout, model_dir, echo):
    from eagle3_assets.definitions import default_resources
    from eagle3_assets.hidden_states.reader import ShardReader
    from eagle3_assets.partitions import datasets_partitions
    from tests.unit.hidden_states.test_hidden_states import make_corpus

    hidden = fresh("eagle3_assets.hidden_states.assets")
    assert "echo" in hidden.EXTRACTION_BACKENDS
    corpus = make_corpus(layout.corpus("qa"), lengths=[5, 9, 3, 12])
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(datasets_partitions.name, ["qa"])
        result = dg.materialize([hidden.hidden_states], partition_key="qa", instance=instance,
                                resources=default_resources(),
                                run_config={"ops": {"hidden_states": {"config": {"backend": "echo"}}}})
        assert result.success
    assert len(EchoExtract.calls) == 1
    reader = ShardReader(layout.hidden_states_dir("qa"), dtype=torch.float32)
    frame = pl.read_parquet(corpus)
    assert sorted(reader.sample_ids()) == sorted(frame["sample_id"].to_list())
    for sid, ids in frame.select("sample_id", "input_ids").iter_rows():
        sample = reader.read(sid)
        aux, last = expected_states(ids)  # from the corpus file, not from what the asset reported
        assert sample.input_ids.tolist() == ids
        torch.testing.assert_close(sample.aux_hidden, aux.to(torch.bfloat16).float())
        torch.testing.assert_close(sample.last_hidden, last.to(torch.bfloat16).float())


def test_the_architecture_page_names_the_files_and_parts_of_a_new_engine():
    text = (REPO / "docs" / "architecture.md").read_text()
    step = text[text.index("**A new engine**"):]
    step = step[:step.index("\n- **", 1)]
    for path in re.findall(r"`(eagle3_assets/[\w/.]+\.py|engines/[\w/.]+\.py|tests/[\w/.]+\.py)`", step):
        full = REPO / path if path.startswith(("eagle3_assets/", "tests/")) else REPO / "eagle3_assets" / path
        assert full.exists(), path
    for part in ["`ROLES`", "`Generate`", "`Extract`", "`Serve`", "engine_role", "roles.py",
                 "tests/unit/engines/test_engines.py"]:
        assert part in step, part
    for name in {name for _, name in ROLES}:  # every engine the registry holds has its folder named on the page
        assert f"engines/{name}/" in text, name
