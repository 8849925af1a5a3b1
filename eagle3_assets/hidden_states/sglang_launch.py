"""The ``hidden_states`` asset's ``sglang`` backend: the job file every rank reads (the launch that
runs it under torchrun is ``hidden_states/launch.py``'s, on the step's launcher)."""

from __future__ import annotations

import os
from pathlib import Path

from eagle3_assets.hidden_states.sglang_extract import SGLangExtractionJob

JOB_FILE = "sglang-job.json"
CAPTURE_ENV = "EAGLE3_SGLANG_CAPTURE"  # module:function replacing SGLang's capture (CPU tests)


def capture_args() -> list[str]:
    """``--capture`` when the environment names a stand-in for SGLang's capture (CPU tests)."""
    return ["--capture", os.environ[CAPTURE_ENV]] if os.environ.get(CAPTURE_ENV) else []


def write_sglang_job(config, spec, corpus: Path, out: Path, nodes: int = 1, model_dtype: str = "auto") -> Path:
    """The job file every rank reads, beside the dataset's hidden-state directory; ``model_dtype`` is
    the target's (``auto`` stays so in the file and is resolved on the rank's own machine)."""
    text = spec.text_config
    job = SGLangExtractionJob(
        engine=config.backend, model_path=str(spec.model_dir), corpus=str(corpus), out_dir=str(out), target=spec.identity,
        num_layers=int(text["num_hidden_layers"]), hidden_size=int(text["hidden_size"]),
        vocab_size=int(text["vocab_size"]), layer_ids=config.layer_ids or None, tp_size=config.tp_size,
        dtype=config.dtype, shard_bytes=config.shard_bytes, batch_tokens=config.batch_tokens,
        retry_quarantined=config.retry_quarantined, trust_remote_code=spec.trust_remote_code,
        max_length=spec.context_length, nodes=nodes, model_dtype=model_dtype,
    )
    out.mkdir(parents=True, exist_ok=True)
    job_path = out.parent / f".{out.name}.{JOB_FILE}"
    job_path.write_text(job.model_dump_json(indent=2))
    return job_path
