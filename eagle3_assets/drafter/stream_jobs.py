"""What the streaming step hands each side: the trainer's spool settings, with the preflight's
capture and training rates as earlier materializations measured them, and each producer's capture
engine settings, through the engine's extract role (the step never names an engine)."""

from __future__ import annotations

from eagle3_assets.engines import engine_role
from eagle3_assets.hidden_states.spool.settings import StreamSettings


def stream_settings_for(layout, recipe, stream, rates: dict | None = None) -> StreamSettings:
    """The training job's spool settings from the step's ``StreamingConfig``; ``rates``: the
    preflight's tokens/s (``measured_rates``)."""
    rates = rates or {}
    return StreamSettings(spool_dir=str(layout.root / "spool" / recipe.name),
                          corpora={str(layout.corpus(d)): float(w) for d, w in recipe.datasets.items()},
                          cap_bytes=stream.cap_bytes, unit_bytes=stream.unit_bytes, high_water=stream.high_water,
                          low_water=stream.low_water, batch_tokens=stream.batch_tokens,
                          wait_timeout_s=stream.wait_timeout_s or None,
                          epochs=stream.epochs, layer_ids=recipe.shape.aux_layer_ids,
                          capture_tokens_per_s=rates.get("capture_tokens_per_s"),
                          train_tokens_per_s=rates.get("train_tokens_per_s"))


def _latest_metadata(instance, key: str, partition: str) -> dict:
    import dagster as dg

    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(key), asset_partitions=[partition]), limit=1).records
    if not records or records[0].asset_materialization is None:
        return {}
    return {k: getattr(v, "value", v) for k, v in records[0].asset_materialization.metadata.items()}


def measured_rates(instance, recipe, stream) -> dict:
    """The preflight's rates in tokens/s, capture (all producers together) and training, each with
    where it came from: the config's when given; else measured by this instance: this recipe's last
    ``drafter_checkpoint`` (a streamed run's capture rate per producer; its training rate with the
    trainer's waits taken out, as any run's ``tokens_per_s`` otherwise), else for capture the recipe's
    datasets' last ``hidden_states`` extraction (one process each, so per producer)."""
    last = _latest_metadata(instance, "drafter_checkpoint", recipe.name)
    capture, capture_from = stream.capture_tokens_per_s or None, "config"
    if capture is None and last.get("stream_capture_tokens_per_s"):
        capture, capture_from = last["stream_capture_tokens_per_s"] * stream.producers, "last streamed run"
    if capture is None:
        extracted = [m["tokens_per_s"] for d in recipe.datasets
                     if (m := _latest_metadata(instance, "hidden_states", d)).get("tokens_per_s")]
        if extracted:
            capture, capture_from = sum(extracted) / len(extracted) * stream.producers, "hidden_states runs"
    train, train_from = stream.train_tokens_per_s or None, "config"
    if train is None and last.get("tokens_per_s"):
        busy = 1.0 - float(last.get("stream_trainer_wait_share") or 0.0)
        train, train_from = last["tokens_per_s"] / max(busy, 1e-3), "last training run"
    return {"capture_tokens_per_s": capture, "train_tokens_per_s": train,
            "rates_from": f"capture: {capture_from if capture else 'unknown'}; training: {train_from if train else 'unknown'}"}


def longest_corpus(corpora) -> str:
    """The corpus holding the longest row: an engine sizes its server or KV pool by it."""
    import polars as pl

    def longest(path):
        return pl.scan_parquet(path).select(pl.col("input_ids").list.len().max()).collect().item() or 0

    return max(corpora, key=longest)


def producer_settings(stream, target, resources, corpora, spec) -> dict:
    """The ``ProducerJob`` fields of the configured capture engine, through its extract role: a
    ``tensor_parallel`` engine's capture runs as one rank in each producer (``tp_size`` 1) with the
    further ``sglang_server_args``; the others' job settings are their extraction job's, sized for
    the recipe's longest row (vLLM's: the server each producer starts)."""
    from types import SimpleNamespace

    role = engine_role("extract", stream.backend)
    if role.tensor_parallel:
        if stream.tp_size != 1:
            raise ValueError(f"stream.tp_size {stream.tp_size} for backend {stream.backend!r}: each producer "
                             "captures as one rank (tp_size: 1); for more capture, raise stream.producers")
        return {"server_args": dict(stream.sglang_server_args), "tp_size": 1}
    shape = SimpleNamespace(tp_size=stream.tp_size, vllm_server_args=list(stream.vllm_server_args))
    return role.job_settings(shape, target, resources, longest_corpus(corpora), spec)


def corpus_train_sizes(layout, datasets) -> dict[str, int]:
    """Training samples per dataset from the corpus (streaming needs no hidden states beforehand)."""
    import polars as pl

    return {d: pl.scan_parquet(layout.corpus(d)).filter(pl.col("split") == "train").select(pl.len()).collect().item()
            for d in datasets}
