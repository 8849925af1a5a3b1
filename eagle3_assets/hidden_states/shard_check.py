"""One shard checked against its manifest entry, its index rows and the corpus (``verify_shards``'
per-shard part): size and sha256, the sample ids, tensor shapes and dtypes, offsets, token-exact ids
and masks (the first differing sample named), finite values."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from eagle3_assets.hidden_states.encoding import dequantize_fp8, sha256_file


@dataclass
class VerifyReport:
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    corpus_samples: int = 0
    stored_samples: int = 0
    quarantined: int = 0
    tokens: int = 0
    shards: int = 0
    bytes: int = 0

    def fail(self, msg: str) -> None:
        self.ok = False
        if len(self.problems) < 100:
            self.problems.append(msg)


def check_shard(path: Path, entry: dict, rows: pl.DataFrame, corpus: pl.DataFrame, manifest: dict,
                 report: VerifyReport, chunk_tokens: int) -> None:
    import numpy as np
    import torch
    from safetensors import safe_open

    name = entry["file"]
    if not path.exists():
        return report.fail(f"{name}: listed in the manifest but missing")
    if path.stat().st_size != entry["bytes"]:
        return report.fail(f"{name}: {path.stat().st_size} bytes on disk, manifest says {entry['bytes']}")
    if sha256_file(path) != entry["sha256"]:
        return report.fail(f"{name}: sha256 does not match the manifest")
    h, w = manifest["hidden_size"], manifest["aux_width"]
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        ids = json.loads(meta.get("sample_ids", "[]"))
        rows = rows.sort("sample_pos")
        if ids != rows["sample_id"].to_list():
            return report.fail(f"{name}: sample ids in the shard differ from the index")
        n = entry["tokens"]
        expect = {"input_ids": [n], "loss_mask": [n], "aux_hidden": [n, w], "last_hidden": [n, h],
                  "offsets": [len(ids) + 1]}
        if manifest["dtype"] == "fp8":
            expect.update(aux_scale=[n], last_scale=[n])
        for key, shape in expect.items():
            if key not in f.keys():
                return report.fail(f"{name}: tensor {key} missing")
            sl = f.get_slice(key)
            if list(sl.get_shape()) != shape:
                return report.fail(f"{name}: {key} has shape {sl.get_shape()}, expected {shape}")
            want = manifest["storage_dtypes"][key]
            got = str(f.get_slice(key)[0:1].dtype).removeprefix("torch.")
            if got != want:
                return report.fail(f"{name}: {key} is {got}, manifest says {want}")
        offsets = f.get_tensor("offsets").tolist()
        lengths = rows["length"].to_list()
        if offsets[:-1] != rows["offset"].to_list() or offsets[-1] != n or \
                [b - a for a, b in zip(offsets, offsets[1:])] != lengths:
            return report.fail(f"{name}: offsets disagree with the index")
        exp = rows.select("sample_id", "sample_pos").join(corpus, on="sample_id", how="left").sort("sample_pos")
        for key in ("input_ids", "loss_mask"):
            want = np.asarray(exp[key].explode().to_numpy(), dtype=np.int64)
            got = f.get_tensor(key).numpy().astype(np.int64)
            if len(want) != n or not np.array_equal(got, want):
                return report.fail(_first_differing_sample(name, key, got, want, offsets, ids))
        for a in range(0, n, chunk_tokens):
            b = min(n, a + chunk_tokens)
            for key in ("aux", "last"):
                x = f.get_slice(f"{key}_hidden")[a:b]
                if manifest["dtype"] == "fp8":
                    x = dequantize_fp8(x, f.get_slice(f"{key}_scale")[a:b])
                if not bool(torch.isfinite(x).all()):
                    return report.fail(f"{name}: non-finite {key} values in tokens {a}..{b}")
    report.tokens += n


def _first_differing_sample(name: str, key: str, got, want, offsets: list[int], ids: list[str]) -> str:
    """Which sample of the shard holds other ``key`` values than the corpus, and where."""
    import bisect

    n = min(len(got), len(want))
    at = next((i for i in range(0, n, 1 << 16) if not (got[i:i + (1 << 16)] == want[i:i + (1 << 16)]).all()), None)
    if at is None:
        return f"{name}: {key} holds {len(got):,} tokens, the corpus {len(want):,} for its samples"
    at += int((got[at:at + (1 << 16)] != want[at:at + (1 << 16)]).argmax())
    k = bisect.bisect_right(offsets, at) - 1
    differ = "differs" if key == "loss_mask" else "differ"
    return (f"{name}: {key} of sample {ids[k]} {differ} from the corpus (first at its token {at - offsets[k]}: "
            f"{int(got[at])} stored, {int(want[at])} in the corpus)")


def shard_file_problems(directory: Path | str, manifest: dict, *, part: int = 0, parts: int = 1,
                        threads: int = 4) -> tuple[list[str], int]:
    """Every ``parts``-th shard the manifest lists, from the ``part``-th: on disk, of its recorded size
    and sha256 (what a reader checks before it trusts any row of it). Hashed on ``threads`` threads
    (hashlib releases the GIL on large blocks). Returns (problems, bytes read)."""
    from concurrent.futures import ThreadPoolExecutor

    directory = Path(directory)

    def one(entry: dict) -> tuple[str | None, int]:
        path = directory / entry["file"]
        if not path.exists():
            return f"{path}: listed in the manifest but missing", 0
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"{path}: {size:,} bytes on disk, the manifest records {entry['bytes']:,}", 0
        if sha256_file(path) != entry["sha256"]:
            return f"{path}: its sha256 is not the one the manifest records (its bytes changed after extraction)", size
        return None, size

    with ThreadPoolExecutor(max(1, threads)) as pool:
        done = list(pool.map(one, manifest["shards"][part::max(1, parts)]))
    return [p for p, _ in done if p], sum(n for _, n in done)
