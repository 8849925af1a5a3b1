"""The headless command line: what runs without a webserver."""

import pytest

from eagle3_assets import cli


def test_backfill_without_a_webserver_says_so(capsys):
    rc = cli.main(["backfill", "alpha", "beta", "--url", "http://127.0.0.1:9"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "no Dagster webserver at http://127.0.0.1:9" in err and "eagle3 ui" in err


def test_backfill_rejects_a_bad_dataset_name(capsys):
    assert cli.main(["backfill", "bad name"]) == 2
    assert "not usable as a partition key" in capsys.readouterr().err


def test_export_without_a_drafter(layout, capsys):
    assert cli.main(["export", "demo"]) == 2
    out = capsys.readouterr()
    assert str(layout.drafter_dir("demo") / "sglang") in out.out
    assert "materialize drafter_checkpoint[demo]" in out.err


def test_export_reports_an_invalid_sglang_export(layout, capsys):
    d = layout.drafter_dir("demo") / "sglang"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    assert cli.main(["export", "demo"]) == 1
    assert "config.json or model.safetensors is missing" in capsys.readouterr().err


def test_materialize_needs_a_prompt_file(layout, capsys):
    assert cli.main(["materialize", "nothing"]) == 2
    assert "no prompt file" in capsys.readouterr().err


@pytest.mark.model
def test_materialize_runs_a_dataset_through_the_corpus_in_the_instance(layout, model_dir, monkeypatch, capsys):
    import dagster as dg

    from tests.conftest import small_prompts, write_jsonl

    monkeypatch.setenv("DAGSTER_HOME", str(layout.root / "dagster"))
    write_jsonl(layout.prompt_source("tiny"), small_prompts(2))
    assert cli.main(["materialize", "tiny", "--max-new-tokens", "8", "--batch-size", "2"]) == 0
    assert layout.corpus("tiny").exists()
    instance = dg.DagsterInstance.get()
    runs = instance.get_runs()
    assert len(runs) == 1 and runs[0].tags.get("dagster/partition") == "tiny"
    assert runs[0].status == dg.DagsterRunStatus.SUCCESS
    assert "tiny through merged_corpus: ok" in capsys.readouterr().out
