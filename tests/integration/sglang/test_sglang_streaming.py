"""A streamed run whose producer captures through SGLang's in-process capture, chosen as a user
chooses it in ``drafter_checkpoint``'s config (``stream: {backend: sglang, python: ...}``, one rank):
the step's ``StreamRun`` starts the producer with SGLang's own interpreter (``.venv-sglang``), which
turns SGLang's CPU engine on by itself and builds the capture through the engine's extract role, as
each rank of ``sglang_extract`` does.

Every unit the SGLang producer published holds, for each of its samples, the local extractor's
float32 states within the tolerance of ``test_sglang_capture_real``: per token, the largest
difference is at most 2**-8 of that token's largest magnitude. The spool's bf16 rounding alone
stays within it (round to nearest with 8 significant bits: at most 2**-8 / (1 + 2**-8) = 3.89e-3 of
the element itself, against 3.91e-3), and the engines' float32 difference (2.7e-7 in
``test_sglang_capture_real``) fits in the rest; 3.7e-3 was observed here in one run. The trainer
then consumes every sample once (its own step records in the checkpoint), and the spool ends empty.

As in the vLLM version (``tests/integration/vllm/test_vllm_streaming.py``), the producer is started
against a plan written the way the trainer writes it, with a cap that holds the whole corpus, so it
publishes every unit before the trainer (same settings, so the same plan) reads them: the units can
be read here before they are consumed and deleted. ``make sglang`` puts ``polars`` in SGLang's
environment for the producer; the project comes from this checkout, on the producer's ``PYTHONPATH``.
Scale: 12 samples of 26-48 tokens, one epoch of 4 steps.
"""

from __future__ import annotations

import json

import pytest

from eagle3_assets.hidden_states.shards import MANIFEST
from tests.support.streaming import (
    assert_each_sample_trained_once,
    captured_units,
    engine_producer_setup,
    producer_log,
    producers_as_the_step_starts_them,
    published_samples,
    train_job,
    wait_for,
)

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.model,
    pytest.mark.usefixtures("one_torch_thread"),  # the other core is the producer's
]
BF16_STEP = 2.0 ** -8
CPU_SERVER_ARGS = {"device": "cpu", "attention_backend": "torch_native", "mem_fraction_static": 0.1}


def test_a_sglang_producer_chosen_in_the_config_feeds_a_streamed_run(model_dir, tmp_path):
    from eagle3_assets.drafter.training.job import run_job
    from eagle3_assets.engines.local.extractor import LocalExtractor
    from eagle3_assets.engines.sglang.server import default_python

    corpus, spool, settings, train, plan = engine_producer_setup(tmp_path)

    # drafter_checkpoint's config `stream: {backend: sglang, python: <SGLang's env>, sglang_server_args: ...}`:
    # the producer runs in SGLang's environment (`make sglang` puts polars there) and turns SGLang's CPU
    # engine on by itself; nothing here prepares its environment
    with producers_as_the_step_starts_them(tmp_path / "out", model_dir, settings, backend="sglang",
                                           python=default_python(), sglang_server_args=CPU_SERVER_ARGS,
                                           producer_restarts=0) as run:
        try:
            wait_for(lambda: len(captured_units(spool)) == len(plan["units"]), 900,
                     "every unit published by the SGLang producer", procs=run.started)
        except AssertionError:
            raise AssertionError(producer_log(run)) from None
        job = json.loads((tmp_path / "out" / "stream" / "producer-0.json").read_text())
        assert (job["backend"], job["tp_size"], job["server_args"]) == ("sglang", 1, CPU_SERVER_ARGS)

        for unit in (spool / "units").iterdir():
            assert json.loads((unit / MANIFEST).read_text())["backend"].startswith("sglang-")  # captured by SGLang
        stored = published_samples(spool)
        ids = sorted(stored)
        assert ids == [f"s{i:03d}" for i in range(12)]
        local = LocalExtractor(model_dir, layer_ids=settings.layer_ids, dtype="float32").extract(
            [stored[i].input_ids.tolist() for i in ids])
        worst = 0.0
        for i, w in zip(ids, local):
            s = stored[i]
            assert s.aux_hidden.shape == (len(s.input_ids), 3 * 576) and s.last_hidden.shape == (len(s.input_ids), 576)
            for got, ref in ((s.aux_hidden, w.aux), (s.last_hidden, w.last)):
                diff = (got.float() - ref.float()).abs().amax(dim=1)
                scale = ref.float().abs().amax(dim=1)
                worst = max(worst, (diff / scale).max().item())
                assert (diff <= BF16_STEP * scale).all(), f"{i}: worst per-token relative difference {worst}"
        print(f"SGLang producer's units vs the local extractor: worst per-token relative difference {worst:.2e}")

        summary = run_job(train_job(model_dir, tmp_path / "train", stream=settings, settings=train))
    assert [s.poll() for s in run.started] == [0], producer_log(run)  # ended by itself once the run was done

    assert summary["steps"] == 4
    assert_each_sample_trained_once(tmp_path / "train", spool, corpus, steps=4)
    assert {c["producer"] for c in captured_units(spool)} == {"producer-0"}
