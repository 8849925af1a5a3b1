"""Features already in memory -> a hidden-state directory (shards, index, manifest).

For features computed outside ``extract_corpus`` (benchmarks, tests, a custom capture):
the same writer, so readers and training cannot tell the difference.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from eagle3_assets.hidden_states.shards import ShardWriter
from eagle3_assets.target import layers as hidden_layers


def write_samples(out_dir: Path | str, samples: Iterable[dict], *, layer_ids: list[int], num_layers: int,
                  target: dict, dtype: str = "bf16", shard_bytes: int = 1 << 30, split: str = "train",
                  id_prefix: str = "s") -> dict:
    """Write ``{"input_ids", "loss_mask", "aux_hidden", "last_hidden"}`` samples; returns the manifest."""
    writer = None
    for i, s in enumerate(samples):
        if writer is None:
            writer = ShardWriter(out_dir, hidden_size=int(s["last_hidden"].shape[-1]), dtype=dtype,
                                 shard_bytes=shard_bytes, background=False,
                                 meta={"target": target, "layers": hidden_layers.convention(layer_ids, num_layers)})
        writer.add(f"{id_prefix}{i:07d}", s.get("split", split), s["input_ids"].tolist(), s["loss_mask"].tolist(),
                   s["aux_hidden"], s["last_hidden"])
    if writer is None:
        raise ValueError("no samples to write")
    return writer.close({"backend": "in-memory"})
