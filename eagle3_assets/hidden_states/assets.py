"""``hidden_states``: the target's EAGLE-3 features for every sample of a dataset's corpus."""

import hashlib
import json
import sys
import time
from types import SimpleNamespace
from typing import Literal

import dagster as dg

from eagle3_assets.corpus.assets import merged_corpus
from eagle3_assets.engines import engine_names, engine_resources, engine_role
from eagle3_assets.launchers import LauncherName, open_launcher
from eagle3_assets.metadata import md_table
from eagle3_assets.partitions import datasets_partitions
from eagle3_assets.resources import SlurmJobConfig, TargetResource

EXTRACTION_BACKENDS = engine_names("extract")  # the engines serving the extract role: the config's `backend` choices
ExtractionBackend = Literal[EXTRACTION_BACKENDS]


class HiddenStatesConfig(dg.Config):
    backend: ExtractionBackend = "local"  # an engine serving extract: "local" (transformers), "sglang" (torchrun over
    # tp_size GPUs) or "vllm" (a server); eagle3_assets.engines.ROLES lists them
    dtype: str = "bf16"  # shard storage: "bf16" or "fp8" (e4m3 with a per-token scale; half the bytes);
    # the model's own dtype and device are the target resource's (``auto``: bf16 on a GPU, float32 on a CPU)
    shard_bytes: int = 1 << 30
    batch_tokens: int = 4096
    layer_ids: list[int] = []  # empty: the model's default auxiliary layers
    retry_quarantined: bool = False
    tp_size: int = 1  # sglang: tensor-parallel GPUs (torchrun processes); vllm on SLURM: the server's
    tp_across_nodes: bool = False  # sglang on several nodes: one TP group over them all, not one group a node
    launcher: LauncherName = "local"  # "local" (this machine) or "slurm" (one job on the `slurm` resource's cluster)
    slurm: SlurmJobConfig = SlurmJobConfig()  # launcher slurm: this launch's job shape over the resource's
    vllm_server_args: list[str] = []  # vllm on SLURM: further arguments of the server the job starts


def build_extractor(config: HiddenStatesConfig, target: TargetResource, resources=None):
    """The configured engine's extractor in this step (its extract role), reading the one target
    definition; ``resources``: the step's (those the engine's role reads), or the target alone."""
    return engine_role("extract", config.backend).step_extractor(
        target.spec(), layer_ids=config.layer_ids or None, resources=resources or SimpleNamespace(target=target))


@dg.asset(
    partitions_def=datasets_partitions,
    deps=[merged_corpus],
    group_name="hidden_states",
    kinds={"safetensors", "torch"},
    pool="gpu",
    description="Auxiliary + final hidden states per token in sharded safetensors, with index and manifest.",
    # slurm: the launcher's cluster; and every resource an engine serving extract reads
    required_resource_keys={"storage", "target", "slurm", *engine_resources("extract")},
)
def hidden_states(context: dg.AssetExecutionContext, config: HiddenStatesConfig) -> dg.MaterializeResult:
    from tqdm import tqdm

    from eagle3_assets.hidden_states.extract import extract_corpus

    dataset = context.partition_key
    target = context.resources.target
    layout = context.resources.storage.layout
    out = layout.hidden_states_dir(dataset)
    launcher = open_launcher(config.launcher, context, config, layout)
    if not (launcher.here and engine_role("extract", config.backend).in_step):
        from eagle3_assets.hidden_states.launch import launch_extraction

        report, job_meta = launch_extraction(context, config, target, context.resources, launcher, layout, dataset)
        return hidden_states_result(context, config, out, report, job_meta)
    extractor = build_extractor(config, target, context.resources)
    bar = tqdm(desc=f"hidden states {dataset}", unit="tok", unit_scale=True, file=sys.stderr)
    last_log = [time.monotonic()]

    def progress(rep):
        bar.total = rep.tokens_todo
        bar.update(rep.tokens_extracted - bar.n)
        if time.monotonic() - last_log[0] > 10:
            last_log[0] = time.monotonic()
            context.log.info(f"{rep.extracted} samples, {rep.tokens_extracted:,} tokens, {rep.tokens_per_s:,.0f} tokens/s")

    try:
        report = extract_corpus(
            layout.corpus(dataset), out, extractor, dtype=config.dtype, shard_bytes=config.shard_bytes,
            batch_tokens=config.batch_tokens, progress=progress, retry_quarantined=config.retry_quarantined,
        )
    finally:
        bar.close()
        if hasattr(extractor, "close"):
            extractor.close()
    return hidden_states_result(context, config, out, report)


def hidden_states_result(context, config: HiddenStatesConfig, out, report, job_meta: dict | None = None) -> dg.MaterializeResult:
    manifest = json.loads((out / "manifest.json").read_text())
    tokens = manifest["num_tokens"]
    if report.quarantined_total:
        context.log.warning(f"{report.quarantined_total} samples quarantined (non-finite states or bad rows)")
    return dg.MaterializeResult(
        metadata={
            "samples_planned": report.planned,
            "extracted_now": report.extracted,
            "already_done": report.already_done,
            "quarantined": report.quarantined_total,
            "tokens": tokens,
            "bytes": manifest["bytes"],
            "bytes_per_token": manifest["bytes_per_token"],
            "payload_bytes": manifest["payload_bytes"],
            "disk_needed_with_margin": report.preflight.get("need_bytes"),
            "free_bytes_before": report.preflight.get("free_bytes"),
            # this run's extraction speed; a resumed run that found everything stored has none (not 0.0,
            # which read as the extraction's own figure replaced by the resume's)
            "tokens_per_s": round(report.tokens_per_s, 1) if report.tokens_extracted else None,
            "tokens_extracted_now": report.tokens_extracted,
            "shards": report.shards_total,
            "shards_kept_from_earlier_runs": report.shards_kept,
            "dtype": config.dtype,
            "target": f"{manifest['target'].get('name')} (id {manifest['target'].get('id')})",
            "aux_layer_ids": str(manifest["layers"]["aux_layer_ids"]),
            "hf_hidden_states_index": str(manifest["layers"]["hf_hidden_states_index"]),
            "layer_convention": manifest["layers"]["convention"],
            "quarantined_samples": md_table(manifest.get("quarantined", [])[:20]),
            "manifest": dg.MetadataValue.path(str(out / "manifest.json")),
            **(job_meta or {}),
        },
        data_version=dg.DataVersion(
            hashlib.sha256(json.dumps(manifest.get("shards", []), sort_keys=True).encode()).hexdigest()[:16]),
    )
