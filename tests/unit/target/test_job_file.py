"""The entry scaffold every launched job's __main__ calls (job_file.run_job_main)."""

import json

from eagle3_assets.job_file import JobFile, run_job_main


class Job(JobFile):
    name: str
    steps: int = 1


class TooBig(ValueError):
    pass


def _main(path, run, **kw):
    return run_job_main(Job, run, ["--config", str(path), *kw.pop("extra", [])], description="a job", **kw)


def test_the_job_is_read_run_and_cleaned_up(tmp_path, monkeypatch):
    monkeypatch.delenv("DAGSTER_PIPES_CONTEXT", raising=False)
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"name": "a", "steps": 3}))
    seen, cleaned = [], []

    def run(job, args, pipes):
        seen.append((job, args.capture, pipes))
        return 5

    assert _main(path, run, options={"--capture": {"default": None}}, extra=["--capture", "m:f"],
                 cleanup=lambda: cleaned.append(1)) == 5
    assert seen == [(Job(name="a", steps=3), "m:f", None)] and cleaned == [1]


def test_a_bad_file_names_file_and_field_and_runs_nothing(tmp_path, capsys):
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"name": "a", "steps": "many"}))
    assert _main(path, lambda *a: 0 / 0) == 2
    assert f"{path}: field 'steps'" in capsys.readouterr().err


def test_a_refusal_is_one_line_and_status_2_and_cleanup_still_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("DAGSTER_PIPES_CONTEXT", raising=False)
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"name": "a"}))
    cleaned = []

    def run(job, args, pipes):
        raise TooBig("the step does not fit")

    assert _main(path, run, refused=(TooBig,), cleanup=lambda: cleaned.append(1)) == 2
    assert capsys.readouterr().err == f"error: {path}: the step does not fit\n" and cleaned == [1]


def test_a_process_that_does_not_report_opens_no_pipes(tmp_path, monkeypatch):
    """With DAGSTER_PIPES_CONTEXT set (a bogus one: opening it would fail), a process that is not the
    reporting one runs without Pipes."""
    monkeypatch.setenv("DAGSTER_PIPES_CONTEXT", "not a pipes context")
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"name": "a"}))
    seen = []
    assert _main(path, lambda job, args, pipes: seen.append(pipes), reports=lambda job: job.name != "a") == 0
    assert seen == [None]
