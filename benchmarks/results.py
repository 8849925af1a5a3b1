"""A benchmark's figures as a small JSON file with the conditions they were measured under.

Every benchmark under ``benchmarks/`` prints its figures and, on the same path, calls
:func:`record`, which writes ``benchmarks/results/<name>.json``: the figures, what was run, and the
conditions (commit, machine, load, date). A docs table that cites such a file is checked against
it by ``tests/unit/project/test_doc_figures.py``, so a figure in the docs cannot differ from the run it cites.
``EAGLE3_RESULTS_DIR`` moves the folder (a smoke run need not overwrite the recorded one).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"


def results_dir() -> Path:
    return Path(os.environ.get("EAGLE3_RESULTS_DIR") or RESULTS_DIR)


def _commit() -> str:
    """The checkout's commit, with ``+dirty`` when tracked files differ from it."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def conditions() -> dict:
    """Where and when: commit, machine (CPUs, memory, Python, OS), 1/5/15-minute load, UTC date."""
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        mem_gib = None
    return {
        "commit": _commit(),
        "machine": {"cpus": os.cpu_count(), "memory_gib": mem_gib, "python": platform.python_version(),
                    "platform": platform.platform(), "node": platform.node()},
        "load": _load(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def record(name: str, figures: dict, *, command: list[str] | None = None, note: str = "") -> Path:
    """Write ``<results dir>/<name>.json`` (replacing the last run's) and say where, on stderr.

    ``figures`` is what the benchmark printed, as numbers: a flat dict, or one dict per table row
    (``{row: {column: value}}``) for figures the docs show as a table."""
    out = results_dir() / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "command": command if command is not None else [Path(sys.argv[0]).name, *sys.argv[1:]],
               "conditions": conditions(), "figures": figures}
    if note:
        payload["note"] = note
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, out)
    print(f"results: {out}", file=sys.stderr)
    return out


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e-2 and value else f"{value:.3f}" if abs(value) < 100 else f"{value:,.1f}"
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def doc_table(name: str, key_path: str = "", keys: list[str] | None = None) -> str:
    """The tagged Markdown table of a result file's figures at ``key_path`` (``figure | value``
    for a flat object, one row per key otherwise), as ``tests/unit/project/test_doc_figures.py`` checks it."""
    path = results_dir() / f"{name}.json"
    obj = json.loads(path.read_text())["figures"]
    for key in filter(None, key_path.split(".")):
        obj = obj[key]
    rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    tag = f"<!-- figures: {rel} {key_path} -->" if key_path else f"<!-- figures: {rel} -->"
    rows = [k for k in (keys or obj) if k in obj]
    if all(not isinstance(obj[k], dict) for k in rows):
        lines = ["| figure | value |", "|---|---|", *(f"| {k} | {_cell(obj[k])} |" for k in rows)]
    else:
        columns = [c for c in obj[rows[0]] if not isinstance(obj[rows[0]][c], (dict, list))]
        lines = ["| row | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 1),
                 *(f"| {k} | " + " | ".join(_cell(obj[k].get(c)) for c in columns) + " |" for k in rows)]
    return "\n".join([tag, *lines])


if __name__ == "__main__":  # python benchmarks/results.py NAME [KEY.PATH] [KEY ...]: print a docs table
    print(doc_table(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "", sys.argv[3:] or None))
