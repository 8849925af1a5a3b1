"""A streamed run whose producer captures through a real vLLM, chosen as a user chooses it in
``drafter_checkpoint``'s config (``stream: {backend: vllm}``): the step's ``StreamRun`` writes the
producer's job and starts it through the local launcher; the producer process starts its own
extraction server from ``.venv-vllm`` on the embedded SmolLM2 target.

vLLM's states differ from the local extractor's in the last float32 bits (the tolerance of
``test_vllm_extraction``), and the spool stores them in bf16, where such a difference can flip a
rounding: training on them is close to, not equal to, a run on the local extractor's states. So
this checks what must hold exactly or within that tolerance: every unit the vLLM producer
published holds, for each of its samples, the local extractor's states within the bf16 tolerance
``test_vllm_extraction`` uses for stored shards; the trainer then consumes every sample once (its
own step records in the checkpoint), and the spool ends empty.

The producer is started against a plan written the way the trainer writes it, with a cap that
holds the whole corpus, so it publishes every unit before the trainer (same settings, so the
same plan) starts reading: the units can be read here before they are consumed and deleted.
Scale: 12 samples of 26-48 tokens, one epoch of 4 steps; one vLLM server (70-170 s on 2 cores).
"""

from __future__ import annotations

import json

import pytest
import torch

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
    pytest.mark.vllm,
    pytest.mark.model,
    pytest.mark.usefixtures("one_torch_thread"),  # the other core is the server's
]


def _relative_error(a, b) -> float:
    """Largest per-token ||a - b|| / ||b|| (as in test_vllm_extraction)."""
    return float(((a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1).clamp_min(1e-6)).max())


def test_a_vllm_producer_chosen_in_the_config_feeds_a_streamed_run(model_dir, tmp_path):
    from eagle3_assets.drafter.training.job import run_job
    from eagle3_assets.engines.local.extractor import LocalExtractor

    corpus, spool, settings, train, plan = engine_producer_setup(tmp_path)

    # drafter_checkpoint's config `stream: {backend: vllm}`: the step's StreamRun writes the producer's
    # job (the vLLM server's settings from the extract role, sized for the corpus) and starts it
    with producers_as_the_step_starts_them(tmp_path / "out", model_dir, settings, backend="vllm",
                                           producer_restarts=0) as run:
        wait_for(lambda: len(captured_units(spool)) == len(plan["units"]), 900,
                 "every unit published by the vLLM producer", procs=run.started)
        job = json.loads((tmp_path / "out" / "stream" / "producer-0.json").read_text())
        assert job["backend"] == "vllm" and job["vllm"]["max_model_len"] == 256  # the corpus's 48 tokens + 1, rounded up
        assert "vLLM extraction server ready" in producer_log(run)

        # what the vLLM producer published, against the local extractor on the same ids
        stored = published_samples(spool)
        ids = sorted(stored)
        assert ids == [f"s{i:03d}" for i in range(12)]
        local = LocalExtractor(model_dir, layer_ids=settings.layer_ids, dtype="float32").extract(
            [stored[i].input_ids.tolist() for i in ids])
        errors = []
        for i, w in zip(ids, local):
            s = stored[i]
            assert s.aux_hidden.shape == (len(s.input_ids), 3 * 576) and s.last_hidden.shape == (len(s.input_ids), 576)
            errors.append(max(_relative_error(s.aux_hidden, w.aux.to(torch.bfloat16)),
                              _relative_error(s.last_hidden, w.last.to(torch.bfloat16))))
        print(f"vLLM producer's units vs the local extractor: largest relative error {max(errors):.2e}")
        assert max(errors) < 1e-2

        summary = run_job(train_job(model_dir, tmp_path / "train", stream=settings, settings=train))
    assert [s.poll() for s in run.started] == [0], producer_log(run)  # ended by itself once the run was done

    assert summary["steps"] == 4
    assert_each_sample_trained_once(tmp_path / "train", spool, corpus, steps=4)
