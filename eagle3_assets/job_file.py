"""Job files: the JSON a Dagster step writes for a process it launches (``torchrun`` workers), and
the one entry scaffold every launched job's ``__main__`` calls (:func:`run_job_main`)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError


class JobFile(BaseModel):
    """A typed job description; unknown fields are refused, and a bad file names the field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def from_json(cls, path: Path | str):
        path = Path(path)
        try:
            return cls.model_validate_json(path.read_text())
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"{path}: field '{field}': {first['msg']}") from None


def open_pipes():
    """The Dagster Pipes context when this process was launched by Pipes (and ``dagster_pipes``
    imports), else None."""
    if not os.environ.get("DAGSTER_PIPES_CONTEXT"):
        return None
    try:
        from dagster_pipes import open_dagster_pipes
    except ImportError:
        return None
    return open_dagster_pipes()


def run_job_main(job_type: type[JobFile], run: Callable, argv: list[str] | None = None, *, description: str,
                 options: dict[str, dict] | None = None, reports: Callable[[JobFile], bool] | None = None,
                 refused: tuple[type[Exception], ...] = (), cleanup: Callable[[], None] | None = None) -> int:
    """``python -m <job> --config job.json [options]``: the job file read as ``job_type`` (a bad one:
    one line naming file and field, status 2), Dagster Pipes opened when this process was launched
    by it and is the one that reports (``reports(job)``, default yes), then ``run(job, args, pipes)``
    (``pipes`` None otherwise) inside it. An exception of ``refused`` is the user's to fix: the job
    file and its message, status 2. ``cleanup`` runs last in every case. Returns ``run``'s status (None: 0)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--config", required=True, help=f"a {job_type.__name__} as JSON")
    for flag, kwargs in (options or {}).items():
        ap.add_argument(flag, **kwargs)
    args = ap.parse_args(argv)
    try:
        job = job_type.from_json(args.config)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        pipes = open_pipes() if reports is None or reports(job) else None
        if pipes is None:
            return run(job, args, None) or 0
        with pipes:
            return run(job, args, pipes) or 0
    except refused as exc:
        print(f"error: {args.config}: {exc}", file=sys.stderr)
        return 2
    finally:
        if cleanup is not None:
            cleanup()
