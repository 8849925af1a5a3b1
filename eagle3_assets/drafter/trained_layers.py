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

from eagle3_assets.engines import engine_role
from eagle3_assets.target.layers import CONVENTION_NAME


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


def trained_layers_for(layers: dict, engine: str) -> list[int]:
    """The training layers in ``engine``'s numbering (its serve role's): the manifest's record of them,
    or, in manifests from before the per-engine record, derived from the convention."""
    serve = engine_role("serve", engine)
    want = layers.get(serve.layer_ids_key)
    return list(want) if want is not None else serve.layer_ids(layers["aux_layer_ids"])


def layer_id_problems(export_ids, layers: dict, engine: str, where: str) -> list[str]:
    """Problems when ``export_ids`` (in ``engine``'s numbering) are not the layers in ``layers``."""
    if layers.get("convention") != CONVENTION_NAME:
        return [f"the training shards use layer convention {layers.get('convention')!r}, not {CONVENTION_NAME!r}: "
                "their ids cannot be compared with the export's"]
    want = trained_layers_for(layers, engine)
    if export_ids is None or list(export_ids) != list(want):
        return [f"{where}: eagle_aux_hidden_state_layer_ids {export_ids} differ from the layers the drafter was "
                f"trained on ({engine} numbering {list(want)}; shards' ids {layers['aux_layer_ids']}, "
                f"convention {layers['convention']})"]
    return []
