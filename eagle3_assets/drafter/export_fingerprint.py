"""Fingerprints of a drafter's serving exports: the sha256 of every file of each export directory.

The trainer records them in ``result.json`` as it writes the exports; the evaluation checks the
export it loads against that record before using it, and records in ``eval.json`` the fingerprints
of every export, the ones it did not load too (an engine serves them; a byte of ``fc.weight`` or
two ``d2t`` entries changed there afterwards is another drafter than the one measured).
``drafter_acceptance`` and ``eagle3 export`` check the files there now against ``eval.json``. The
exports are the recipe's ``engines``, each a folder of that name: nothing here knows one engine
from another.
"""

from __future__ import annotations

from pathlib import Path


def export_fingerprint(export_dir: Path | str) -> dict[str, str]:
    """{file: sha256} of every file under ``export_dir`` (relative paths, sorted)."""
    from eagle3_assets.hidden_states.encoding import sha256_file

    d = Path(export_dir)
    return {p.relative_to(d).as_posix(): sha256_file(p) for p in sorted(d.rglob("*")) if p.is_file()}


def fingerprints(drafter_dir: Path | str, engines) -> dict[str, dict[str, str]]:
    """{engine: its export's fingerprint} for each of ``engines`` whose export is under ``drafter_dir``."""
    d = Path(drafter_dir)
    return {e: export_fingerprint(d / e) for e in engines if (d / e).is_dir()}


def fingerprint_problems(recorded: dict | None, drafter_dir: Path | str, engines, *, by: str, fix: str) -> list[str]:
    """What differs between the exports ``by`` (a file) recorded and the ones under ``drafter_dir``
    now, one sentence per export of ``engines``, each ending in ``fix``; a missing record is one."""
    d, problems = Path(drafter_dir), []
    for engine in engines:
        was = (recorded or {}).get(engine)
        if was is None:
            problems.append(f"{by} records no fingerprint of the {engine} export, so nothing links it to the files "
                            f"there: {fix}")
            continue
        now = export_fingerprint(d / engine) if (d / engine).is_dir() else {}
        changed = sorted(f for f in was.keys() | now.keys() if was.get(f) != now.get(f))
        if changed:
            problems.append(f"the {engine} export is not the one {by} records ({', '.join(changed)} changed since): {fix}")
    return problems
