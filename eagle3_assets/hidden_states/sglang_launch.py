"""The ``hidden_states`` asset's ``sglang`` backend: the job file every rank reads (the launch that
runs it under torchrun is ``hidden_states/launch.py``'s, on the step's launcher)."""

from __future__ import annotations

import os
from pathlib import Path

from eagle3_assets.hidden_states.sglang_extract import SGLangExtractionJob
from eagle3_assets.target.ref import TargetRef

JOB_FILE = "sglang-job.json"
CAPTURE_ENV = "EAGLE3_SGLANG_CAPTURE"  # module:function replacing SGLang's capture (CPU tests)


def capture_args() -> list[str]:
    """``--capture`` when the environment names a stand-in for SGLang's capture (CPU tests)."""
    return ["--capture", os.environ[CAPTURE_ENV]] if os.environ.get(CAPTURE_ENV) else []


def write_sglang_job(config, spec, corpus: Path, out: Path, nodes: int = 1, model_dtype: str = "auto") -> Path:
    """The job file every rank reads, beside the dataset's hidden-state directory; ``model_dtype`` is
    the target's (``auto`` stays so in the file and is resolved on the rank's own machine)."""
    job = SGLangExtractionJob(
        engine=config.backend, target=TargetRef.of(spec), corpus=str(corpus), out_dir=str(out),
        layer_ids=config.layer_ids or None, tp_size=config.tp_size,
        dtype=config.dtype, shard_bytes=config.shard_bytes, batch_tokens=config.batch_tokens,
        retry_quarantined=config.retry_quarantined,
        max_length=spec.context_length, nodes=nodes, model_dtype=model_dtype,
    )
    out.mkdir(parents=True, exist_ok=True)
    job_path = out.parent / f".{out.name}.{JOB_FILE}"
    job_path.write_text(job.model_dump_json(indent=2))
    return job_path
