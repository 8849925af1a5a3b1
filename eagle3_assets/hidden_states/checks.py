"""``shard_integrity``: the blocking check between hidden states and GPU training."""

import dagster as dg

from eagle3_assets.hidden_states.assets import hidden_states
from eagle3_assets.metadata import md_table
from eagle3_assets.partitions import datasets_partitions
from eagle3_assets.resources import StorageResource


@dg.asset_check(asset=hidden_states, blocking=True, partitions_def=datasets_partitions,
                description="Every corpus sample stored once or quarantined and listed; lengths, dims, "
                            "finite values and checksums match the manifest.")
def shard_integrity(context: dg.AssetCheckExecutionContext, storage: StorageResource) -> dg.AssetCheckResult:
    from eagle3_assets.hidden_states.extract import verify_shards

    layout = storage.layout
    dataset = context.partition_key
    rep = verify_shards(layout.hidden_states_dir(dataset), layout.corpus(dataset))
    return dg.AssetCheckResult(
        passed=rep.ok,
        description="; ".join(rep.problems[:5]) or f"{rep.stored_samples} samples, {rep.tokens:,} tokens in {rep.shards} shards",
        metadata={"corpus_samples": rep.corpus_samples, "stored_samples": rep.stored_samples,
                  "quarantined": rep.quarantined, "tokens": rep.tokens, "shards": rep.shards, "bytes": rep.bytes,
                  "problems": md_table([{"problem": p} for p in rep.problems[:20]])},
    )
