"""A streamed run whose producer captures through SGLang's in-process capture (``backend: sglang``,
one rank): the producer runs with SGLang's own interpreter (``.venv-sglang``, CPU engine) and builds
the capture through the engine's extract role, as each rank of ``sglang_extract`` does.

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
be read here before they are consumed and deleted. The SGLang environment has no ``polars``; the
producer gets this interpreter's copy on its ``PYTHONPATH`` (same Python, a self-contained wheel).
Scale: 12 samples of 26-48 tokens, one epoch of 4 steps.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path

import pytest

from eagle3_assets.hidden_states.shards import MANIFEST
from tests.support.streaming import (
    assert_each_sample_trained_once,
    captured_units,
    engine_producer_setup,
    env,
    producer_job,
    published_samples,
    spawn_producer,
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


def polars_site(root):
    """A folder holding links to this interpreter's polars (and its runtime), for the SGLang env."""
    root.mkdir()
    for dist in ("polars", "polars-runtime-32"):
        try:
            d = importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        for top in {f.parts[0] for f in d.files or [] if len(f.parts) > 1 and not f.parts[0].endswith(".dist-info")}:
            src = Path(d.locate_file(top))
            if src.is_dir() and not (root / top).exists():
                (root / top).symlink_to(src)
    return root


def sglang_producer_env(site) -> dict:
    from eagle3_assets.engines.sglang.cpu import server_environment

    e = server_environment(env())
    e["PYTHONPATH"] += os.pathsep + str(site)
    e["SGLANG_USE_CPU_ENGINE"] = "1"
    return e


def test_a_sglang_producer_feeds_a_streamed_run(model_dir, tmp_path):
    from eagle3_assets.drafter.training.job import run_job
    from eagle3_assets.engines.local.extractor import LocalExtractor
    from eagle3_assets.engines.sglang.server import default_python

    corpus, spool, settings, train, plan = engine_producer_setup(tmp_path)

    job = producer_job(spool, model_dir).model_copy(update={"backend": "sglang", "server_args": CPU_SERVER_ARGS})
    (tmp_path / "producer.json").write_text(job.model_dump_json())
    log = tmp_path / "producer.log"
    producer = spawn_producer(tmp_path / "producer.json", log, python=default_python(),
                              environ=sglang_producer_env(polars_site(tmp_path / "site")))
    try:
        try:
            wait_for(lambda: len(captured_units(spool)) == len(plan["units"]), 900,
                     "every unit published by the SGLang producer", procs=[producer])
        except AssertionError:
            raise AssertionError(log.read_text()[-4000:]) from None

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
        assert producer.wait(300) == 0, log.read_text()[-3000:]
    finally:
        if producer.poll() is None:
            producer.kill()
            producer.wait()

    assert summary["steps"] == 4
    assert_each_sample_trained_once(tmp_path / "train", spool, corpus, steps=4)
    assert {c["producer"] for c in captured_units(spool)} == {"p0"}
