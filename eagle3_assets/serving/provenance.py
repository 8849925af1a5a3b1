"""Where every figure comes from: the export's sha256, the engine and its version, the exact serve
command, the benchmark's hash, the machine; and the cache key built from them."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path


def export_sha256(export_dir: Path | str) -> str:
    """One sha256 over every file of an export (its relative path and its own sha256, sorted)."""
    from eagle3_assets.drafter.export_fingerprint import export_fingerprint

    files = export_fingerprint(export_dir)
    if not files:
        raise FileNotFoundError(f"no export files under {export_dir}")
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def machine() -> str:
    """This machine as figures depend on it: the CPU model, its cores, the accelerator if any."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = os.environ.get("EAGLE3_GPU_NAME", "")
    return f"{cpu}, {os.cpu_count()} cores" + (f", {gpu}" if gpu else "")


def cell_key(cell, *, export_sha: str, engine_version: str, bench_hash: str, machine_name: str,
             max_new_tokens: int, target_id: str) -> str:
    """The cache key of one cell: what must be equal for a journal line to stand for it."""
    # the export's sha256 keys the baseline's cells too: a speedup is against a baseline of the same run
    what = {"cell": cell.key, "export": export_sha, "engine": engine_version,
            "bench": bench_hash, "machine": machine_name, "max_new_tokens": max_new_tokens, "target": target_id,
            "requests": "at least the level"}  # a cell sends its category's prompts cycled up to its level
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def complete(prov: dict) -> bool:
    """Whether a figure's provenance names everything it must (a figure without it is not shown)."""
    need = ("engine", "engine_version", "serve_command", "bench_hash", "machine")
    return all(prov.get(k) for k in need) and (prov.get("baseline") or bool(prov.get("export_sha256")))
