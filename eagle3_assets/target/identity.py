"""A target's identity: what every stage records so data from two targets never mixes.

The identity hashes the model's ``config.json`` and its weight *layout* (the safetensors index,
or each safetensors file's header and size), never the weight bytes: reading a 1 TB checkpoint
to name it would take longer than using it. Two checkpoints with the same config, tensor names,
shapes, dtypes and file sizes share an identity; a different model, size or conversion does not.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"


def _safetensors_header(path: Path) -> bytes:
    with path.open("rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return fh.read(n)


def weights_fingerprint(model_dir: Path) -> str:
    """sha256 over the weight layout: the index file, else every safetensors header and size."""
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    index = model_dir / INDEX_FILE
    if index.is_file():
        data = json.loads(index.read_text())
        h.update(json.dumps(data.get("weight_map", data), sort_keys=True).encode())
    files = sorted(model_dir.glob("*.safetensors"))
    if not files and not index.is_file():
        raise FileNotFoundError(f"{model_dir} holds no safetensors weights")
    for f in files:
        h.update(f.name.encode())
        h.update(str(f.stat().st_size).encode())
        h.update(_safetensors_header(f))
    return h.hexdigest()


def target_identity(model_dir: Path | str, name: str | None = None) -> dict:
    """``{"name", "id", "config_sha256", "weights_sha256", "architectures", "revision"}``.

    ``id`` is the short form shown in messages; manifests and checkpoints store the whole dict.
    """
    model_dir = Path(model_dir)
    raw = (model_dir / "config.json").read_bytes()
    config = json.loads(raw)
    config_sha = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    weights_sha = weights_fingerprint(model_dir)
    source = model_dir / "SOURCE"
    return {
        "name": name or model_dir.name,
        "id": hashlib.sha256(f"{config_sha}:{weights_sha}".encode()).hexdigest()[:16],
        "config_sha256": config_sha,
        "weights_sha256": weights_sha,
        "architectures": list(config.get("architectures") or []),
        "revision": source.read_text().strip() if source.is_file() else config.get("_commit_hash"),
    }


class TargetMismatchError(ValueError):
    """Data produced by one target offered to a stage configured with another."""


def describe_identity(ident: dict | None) -> str:
    if not ident:
        return "an unrecorded target"
    return f"{ident.get('name', '?')} (id {ident.get('id', '?')})"


def check_same_target(recorded: dict | None, current: dict, what: str) -> None:
    """Raise :class:`TargetMismatchError` naming both targets unless ``recorded`` is ``current``."""
    if not recorded or recorded.get("id") != current.get("id"):
        raise TargetMismatchError(
            f"{what} was produced by {describe_identity(recorded)}, but the configured target is "
            f"{describe_identity(current)}; re-extract it with this target or configure the target it was made with"
        )
