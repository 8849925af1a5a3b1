"""A resumed hidden-state extraction that finds every sample stored reports no extraction speed
rather than 0.0 tokens/s in place of the extraction's own figure."""

import json
from types import SimpleNamespace

from eagle3_assets.hidden_states.assets import HiddenStatesConfig, hidden_states_result
from eagle3_assets.hidden_states.extract import ExtractionReport
from eagle3_assets.target.layers import convention


def _result(tmp_path, report):
    manifest = {"num_tokens": 1000, "bytes": 10, "bytes_per_token": 0.01, "payload_bytes": 10, "shards": [],
                "target": {"name": "t", "id": "x"}, "layers": convention([1, 14, 26], 30)}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    ctx = SimpleNamespace(log=SimpleNamespace(warning=print, info=print))
    return hidden_states_result(ctx, HiddenStatesConfig(), tmp_path, report).metadata


def test_a_resume_with_nothing_to_extract_reports_no_speed(tmp_path):
    first = _result(tmp_path, ExtractionReport(out_dir=tmp_path, planned=10, extracted=10, tokens_extracted=1000, seconds=4.0))
    assert first["tokens_per_s"] == 250.0
    resumed = _result(tmp_path, ExtractionReport(out_dir=tmp_path, planned=10, already_done=10, seconds=0.01))
    assert resumed["tokens_per_s"] is None, resumed["tokens_per_s"]
    assert (first["tokens_extracted_now"], resumed["tokens_extracted_now"]) == (1000, 0)
