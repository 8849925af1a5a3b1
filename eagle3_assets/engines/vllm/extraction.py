"""vLLM's hidden-state extraction: the servers the ``vllm`` resource names (in the step), or a server
the extraction job starts on its own node (``VLLMServerSpec``, carried in the job file)."""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field


class VLLMServerSpec(BaseModel):
    """The extraction server the job starts (``VLLMServer`` role ``extract``)."""

    model_config = ConfigDict(extra="forbid")

    python: str  # the vLLM environment's interpreter on the node
    served_name: str = ""
    dtype: str = "float32"  # the target's; auto: bfloat16 where the node sees a GPU, else float32
    max_model_len: int = Field(2048, ge=2)
    enforce_eager: bool | None = True  # None: eager where the node has no GPU
    tensor_parallel_size: int = Field(1, ge=1)
    kv_cache_gib: int = Field(2, ge=1)
    extra_args: list[str] = []
    concurrency: int = Field(8, ge=1)
    ready_timeout_s: float = 1800.0


def server_spec(config, target, vllm, slurm, corpus, spec) -> VLLMServerSpec:
    """The in-job server: the target's dtype, room for the corpus's longest sequence (+1 generated
    token), eager on CPU only, tensor parallel over ``tp_size`` GPUs."""
    import polars as pl

    from eagle3_assets.engines.vllm.server import default_python

    longest = int(pl.scan_parquet(corpus).select(pl.col("input_ids").list.len().max()).collect().item() or 1)
    need = -(-(longest + 1) // 256) * 256
    if spec.context_length:
        need = min(need, spec.context_length)
    return VLLMServerSpec(python=slurm.vllm_python or default_python(), served_name=spec.served_name,
                          dtype=target.dtype, max_model_len=need,
                          enforce_eager=None if target.device == "auto" else target.device == "cpu",
                          tensor_parallel_size=config.tp_size, extra_args=list(config.vllm_server_args),
                          concurrency=vllm.extraction_concurrency)


def step_extractor(vllm, spec, layer_ids=None):
    """A :class:`~eagle3_assets.engines.vllm.extractor.VLLMExtractor` over the servers ``vllm`` (the
    resource) names, for the target ``spec``."""
    from eagle3_assets.engines.vllm.extractor import VLLMExtractor

    return VLLMExtractor(vllm.extraction_urls, spec.model_dir, layer_ids=layer_ids, preferred_model=spec.served_name,
                         api_key=vllm.api_key or None, concurrency=vllm.extraction_concurrency,
                         read_timeout_s=vllm.read_timeout_s, target=spec.identity)


def job_extractor(job, stack):
    """Start the job's extraction server on this node (stopped when ``stack`` closes) and extract through it."""
    from eagle3_assets.engines.vllm import server as vllm_server
    from eagle3_assets.engines.vllm.extractor import VLLMExtractor, vllm_layer_ids
    from eagle3_assets.target.layers import resolve_layer_ids
    from eagle3_assets.target.precision import cuda_available, resolve_dtype

    if job.vllm is None:
        raise ValueError("backend vllm needs the 'vllm' server settings")
    s = job.vllm
    target = job.target.open()
    layers = target.num_layers
    ids = resolve_layer_ids(layers, job.layer_ids)
    extra = [*s.extra_args] + (["--tensor-parallel-size", str(s.tensor_parallel_size)] if s.tensor_parallel_size > 1 else [])
    server = vllm_server.VLLMServer(target.model_dir, role="extract", python=s.python, served_name=s.served_name,
                                    dtype=resolve_dtype(s.dtype), max_model_len=s.max_model_len,
                                    enforce_eager=not cuda_available() if s.enforce_eager is None else s.enforce_eager,
                                    kv_cache_gib=s.kv_cache_gib, vllm_layer_ids=vllm_layer_ids(ids, layers),
                                    extra_args=extra)
    server.start()
    stack.callback(server.stop)
    print(f"vLLM extraction server starting on {os.uname().nodename}, log {server.log_path}", flush=True)
    server.wait_ready(s.ready_timeout_s)
    print(f"vLLM extraction server ready: {server.api_url}", flush=True)
    extractor = VLLMExtractor(server.api_url, target.model_dir, layer_ids=job.layer_ids, preferred_model=server.served_name,
                              concurrency=s.concurrency, target=target.identity)
    stack.callback(extractor.close)
    return extractor
