"""``drafter_checkpoint`` in streaming mode: one materialization starts the producers and the
trainer, with no ``hidden_states`` materialized, and reports both sides in its metadata. The demo
recipe's datasets, up to merged_corpus, are the session's (``demo_datasets``,
tests/support/demo_data.py), shared with the offline test of the same recipe."""

import json

import dagster as dg
import pytest

from eagle3_assets.drafter.recipes import load_recipe
from tests.support.dagster_helpers import run_drafter
from tests.support.demo_data import install_demo_datasets

pytestmark = pytest.mark.model


def test_demo_recipe_streams_from_one_materialization(layout, demo_datasets):
    recipe = load_recipe("demo")
    cap = 24 << 20
    with dg.instance_for_test() as instance:
        install_demo_datasets(demo_datasets, layout, instance, recipe.datasets)
        result = run_drafter(instance, "demo", config={"threads": 1, "stream": {"cap_bytes": cap, "unit_bytes": 1 << 20,
                                                                                "progress_every_s": 2.0}})
        assert result.success, [e.message for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
        logged = [e.user_message for e in instance.all_logs(result.run_id)]
    meta = {k: v.value for k, v in result.asset_materializations_for_node("drafter_checkpoint")[0].metadata.items()}
    assert not any(layout.hidden_states_dir(d).exists() for d in recipe.datasets)  # nothing stored offline
    spool = layout.root / "spool" / "demo"
    plan = json.loads((spool / "plan.json").read_text())
    captured = [json.loads(x) for x in (spool / "captures.jsonl").read_text().splitlines()]
    assert meta["stream_units_captured"] == len(captured) >= len(plan["units"]) == meta["stream_units_planned"]
    assert 0 < meta["stream_peak_spool_bytes"] <= meta["stream_cap_bytes"] == cap
    assert meta["stream_trainer_wait_s"] > 0 and meta["stream_producer_wait_share"] is not None
    assert not any((spool / "units").iterdir()) and (spool / "done.json").exists()
    assert meta["acceptance_length"] >= 1.0 and meta["steps"] == plan["total_steps"]
    assert (meta["stream_backend"], meta["stream_producers"]) == ("local", 1)
    # the step's log, while it ran: both sides' progress and the spool's bytes against the cap
    progress = [m for m in logged if m.startswith("streaming: capture ")]
    assert progress and all(f"bytes of {cap:,}" not in m and f"of {cap:,} bytes" in m for m in progress), progress
    assert f"of {len(plan['units'])} units; training step" in progress[-1]
    # the trainer's preflight, shown in the step's log and metadata: the offline bytes and the least workable cap
    preflight = json.loads((spool / "preflight.json").read_text())
    assert any(m.startswith(f"streaming: stream preflight: offline would store {preflight['offline_bytes']:,} bytes")
               for m in logged)
    assert meta["stream_preflight_min_cap_bytes"] == preflight["min_cap_bytes"] < cap
    assert meta["stream_capture_tokens_per_s"] > 0  # the next run's preflight rate
