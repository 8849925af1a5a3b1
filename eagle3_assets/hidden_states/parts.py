"""Data-parallel extraction: each node of a job extracts its share of the corpus into a part of its
own, and the parts are folded into the dataset's one set of shards, index and manifest.

A sample's node is a hash of its id modulo the job's node count, so the shares never overlap and
do not depend on the corpus's order. Node ``r`` of ``n`` writes ``parts/<n>-<r>/`` with the same
crash-safe shard writer as a one-node run (its own ``progress.jsonl``), skipping what the main
directory already holds. :func:`merge_parts` moves each part's recorded shards into the main
directory (renamed to the next free shard numbers) and appends their records to its progress
file, then writes the index and the manifest. It runs after the job, and before the next launch,
so the finished shards of a node that died are kept, and a relaunch extracts only what no shard
holds. Each move renames the file, then records it in the main journal: a crash between the two
leaves a file the main directory does not list (removed when it is next opened) and a part record
whose file is gone (skipped), so that shard's samples are redone, never stored twice.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, fields
from pathlib import Path

from eagle3_assets.hidden_states.shards import MANIFEST, PROGRESS, SETTINGS, ShardWriter, read_progress

PARTS = "parts"


def part_dir(out_dir: Path | str, rank: int, world: int) -> Path:
    return Path(out_dir) / PARTS / f"{world}-{rank}"


def node_of(sample_id: str, world: int) -> int:
    """The node (0..world-1) that extracts ``sample_id``."""
    return int.from_bytes(hashlib.sha256(sample_id.encode("utf-8")).digest()[:8], "big") % world


def stored_ids(out_dir: Path | str) -> set[str]:
    """Samples the main directory's progress file records (stored or quarantined)."""
    ids: set[str] = set()
    for rec in read_progress(Path(out_dir) / PROGRESS):
        if rec["kind"] == "shard":
            ids.update(s[0] for s in rec["samples"])
        elif rec["kind"] == "quarantine":
            ids.add(rec["sample_id"])
    return ids


def _writer_like(out_dir: Path, part: Path) -> ShardWriter:
    s = json.loads((part / SETTINGS).read_text())
    return ShardWriter(out_dir, hidden_size=s["hidden_size"], dtype=s["dtype"], n_aux=s["n_aux"],
                       meta={"target": s["target"], "layers": s["layers"]}, background=False)


def merge_parts(out_dir: Path | str) -> dict | None:
    """Fold every part into ``out_dir``; the new manifest, or None when there was no part."""
    out_dir = Path(out_dir)
    parts = sorted(p for p in (out_dir / PARTS).glob("*-*") if (p / SETTINGS).exists())
    if not parts:
        return None
    writer = _writer_like(out_dir, parts[0])
    extra = {}
    for part in parts:
        if (part / MANIFEST).exists():
            m = json.loads((part / MANIFEST).read_text())
            extra = {k: m[k] for k in ("corpus", "backend", "extraction") if k in m}
        for rec in read_progress(part / PROGRESS):
            writer.adopt(part, rec)  # a record whose file is gone (an earlier merge that crashed) is skipped
        shutil.rmtree(part)
    shutil.rmtree(out_dir / PARTS, ignore_errors=True)
    return writer.close(extra)


def combine_reports(reports: list, cls):
    """One report for the job: the nodes' counts added up, its time the slowest node's."""
    out = cls(out_dir=reports[0].out_dir)
    for f in fields(cls):
        values = [getattr(r, f.name) for r in reports]
        if f.name == "seconds" or f.name.endswith("_seconds"):
            setattr(out, f.name, max(values))
        elif f.name == "preflight":
            setattr(out, f.name, values[0])
        elif isinstance(values[0], int) and f.name != "out_dir":
            setattr(out, f.name, sum(values))
    return out


def report_name(rank: int, world: int) -> str:
    return f"extraction-report-{world}-{rank}.json"


def write_report(out_dir: Path, report, rank: int, world: int) -> None:
    (Path(out_dir) / report_name(rank, world)).write_text(json.dumps(asdict(report), indent=2))
