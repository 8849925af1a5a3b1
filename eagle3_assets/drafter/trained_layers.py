"""The aux layers a drafter was trained on, read from its training manifests, and an export checked against them.

An export's ``eagle_aux_hidden_state_layer_ids`` tells the engine which target layers to feed the
drafter. Ids that pass every format rule (three, increasing, starting at 1) can still name other
layers than the shards the drafter learned from; the engine then serves it silently on the wrong
features. The truth is the hidden-state manifest of each training dataset (ids and convention),
reached through the ``job.json`` the trainer ran from.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_assets.target.layers import CONVENTION_NAME

ENGINE_IDS = {"sglang": "sglang_layer_ids", "vllm": "speculators_layer_ids"}  # manifest key per engine numbering


def trained_layers(drafter_dir: Path) -> dict:
    """The ``layers`` record of the training shards (all datasets agree, as training required)."""
    job_path = Path(drafter_dir) / "job.json"
    if not job_path.exists():
        raise FileNotFoundError(f"{job_path} is missing: the layers the drafter was trained on are unknown")
    job = json.loads(job_path.read_text())
    if job.get("stream"):  # streamed: the layers every unit held, recorded beside the training by the trainer
        from eagle3_assets.drafter.training.stream import LAYERS

        layers = Path(drafter_dir) / LAYERS
        if not layers.exists():  # a training streamed before the record moved there kept it in the spool
            old = Path(job["stream"]["spool_dir"]) / "layers.json"
            layers = old if old.exists() else layers
        if not layers.exists():
            raise FileNotFoundError(f"{layers} (the streamed training of {job_path}) is missing")
        return json.loads(layers.read_text())
    datasets = job["datasets"]
    records = {}
    for shard_dir in datasets:
        manifest = Path(shard_dir) / "manifest.json"
        if not manifest.exists():
            raise FileNotFoundError(f"{manifest} (a training dataset of {job_path}) is missing")
        records[shard_dir] = json.loads(manifest.read_text())["layers"]
    ids = {tuple(r["aux_layer_ids"]) for r in records.values()}
    if len(ids) != 1:
        raise ValueError(f"{job_path}: the training datasets hold different aux layers: "
                         f"{ {d: r['aux_layer_ids'] for d, r in records.items()} }")
    return next(iter(records.values()))


def layer_id_problems(export_ids, layers: dict, engine: str, where: str) -> list[str]:
    """Problems when ``export_ids`` (in ``engine``'s numbering) are not the layers in ``layers``."""
    if layers.get("convention") != CONVENTION_NAME:
        return [f"the training shards use layer convention {layers.get('convention')!r}, not {CONVENTION_NAME!r}: "
                "their ids cannot be compared with the export's"]
    want = layers.get(ENGINE_IDS[engine])
    if want is None:  # manifests from before the per-engine record: derive it from the convention
        want = [i + (engine == "vllm") for i in layers["aux_layer_ids"]]
    if export_ids is None or list(export_ids) != list(want):
        return [f"{where}: eagle_aux_hidden_state_layer_ids {export_ids} differ from the layers the drafter was "
                f"trained on ({engine} numbering {list(want)}; shards' ids {layers['aux_layer_ids']}, "
                f"convention {layers['convention']})"]
    return []


def export_layer_problems(export_dir: Path, engine: str, layers: dict | None) -> list[str]:
    """The export's ids against the training layers (nothing to compare when ``layers`` is None
    or the config is unreadable: the format checks report that)."""
    cfg_path = Path(export_dir) / "config.json"
    if layers is None or not cfg_path.exists():
        return []
    cfg = json.loads(cfg_path.read_text())
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = nested if engine == "sglang" else cfg.get("eagle_aux_hidden_state_layer_ids", nested)
    return layer_id_problems(ids, layers, engine, "config.json")
