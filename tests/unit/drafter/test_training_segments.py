"""A resumed training keeps the figures of the runs before it: each run is a segment (from the
checkpoint), and the totals result.json reports are computed from all of them, never replaced by
the last run's."""

import copy

import pytest

from eagle3_assets.drafter.training.config import TrainSettings
from eagle3_assets.drafter.training.loop import train
from eagle3_assets.drafter.training.teacher import Teacher
from tests.unit.drafter.test_drafter_recipe_options import Batches, batch_of, tiny_drafter


@pytest.fixture
def setup():
    model, vmap, head = tiny_drafter()
    return model, Teacher(head, vmap), Batches([batch_of([12, 9, 5], head, vmap, seed=i) for i in range(4)])


def test_a_finished_run_resumed_from_its_own_checkpoint_keeps_its_figures(setup, tmp_path):
    """The issue's case: a one-step run, resumed, used to report wall_s ~0.0003 and tokens_per_s 0.0."""
    model, teacher, data = setup
    settings = TrainSettings(max_steps=1, ttt_steps=2, lr=3e-3, checkpoint_every=1)
    first = train(settings, copy.deepcopy(model), data, teacher, tmp_path, progress=False)
    original = first.summary
    assert original["tokens_per_s"] > 0 and original["steps_trained"] == 1
    again = train(settings, copy.deepcopy(model), data, teacher, tmp_path, progress=False)
    s = again.summary
    assert s["segments"][0] == original["segments"][0]  # the original run's figures, as it reported them
    assert s["segments"][1]["steps"] == 0 and s["segments"][1]["resumed"]
    assert (s["tokens_per_s"], s["wall_s"], s["steps_trained"]) == (original["tokens_per_s"], original["wall_s"], 1)


def test_a_crashed_run_resumed_reports_both_segments_and_their_totals(setup, tmp_path):
    model, teacher, data = setup
    settings = TrainSettings(max_steps=6, ttt_steps=2, lr=3e-3, checkpoint_every=3)
    crashed = train(settings, copy.deepcopy(model), data, teacher, tmp_path, progress=False, stop_after=4)
    assert crashed.stopped_early and crashed.segments[0]["last_step"] == 4
    rest = train(settings, copy.deepcopy(model), data, teacher, tmp_path, progress=False)
    a, b = rest.segments
    # step 4 ran before the crash but after the last checkpoint: it is redone, counted once
    assert (a["first_step"], a["last_step"], a["resumed"]) == (1, 3, False)
    assert (b["first_step"], b["last_step"], b["resumed"]) == (4, 6, True)
    assert a["tokens"] == sum(m["tokens"] for m in crashed.metrics[:3])  # the per-step record agrees
    tokens, wall = a["tokens"] + b["tokens"], a["wall_s"] + b["wall_s"]
    assert rest.summary["tokens_per_s"] == pytest.approx(tokens / wall) and rest.summary["wall_s"] == pytest.approx(wall)
    assert rest.summary["steps_trained"] == 6
