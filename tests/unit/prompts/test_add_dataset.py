"""Adding datasets as users have them: `eagle3 add-dataset` and the prompt-file sensor, every format.

User mistakes end with status 2 and one summary, never a traceback. The files are written here.
"""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_assets import cli
from eagle3_assets.definitions import defs
from eagle3_assets.prompts.options import ReadOptions
from eagle3_assets.resources import StorageResource
from eagle3_assets.sensors import prompt_files_sensor
from tests.conftest import small_prompts, write_jsonl


@pytest.fixture
def instance_home(layout, monkeypatch):
    home = layout.root / "dagster"
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    return home


def _partitions(home: Path) -> list[str]:
    with dg.DagsterInstance.from_config(str(home)) as instance:
        return sorted(instance.get_dynamic_partitions("datasets"))


def test_a_data_error_exits_2_with_the_summary_and_no_traceback(tmp_path, layout, instance_home):
    """The issue's edge file (invalid bytes on line 2) plus more bad rows, through the real command."""
    path = tmp_path / "edge_invalid_bytes.jsonl"
    path.write_bytes(b'{"messages": [{"role": "user", "content": "fine"}]}\n'
                     b'{"messages": [{"role": "user", "content": "caf\xe9 au lait"}]}\n'
                     b'{"messages": [{"role": "bot", "content": "x"}]}\n')
    out = subprocess.run([str(Path(sys.executable).with_name("eagle3")), "add-dataset", str(path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    assert out.stderr.startswith(f"error: {path}: 2 of 3 rows cannot be used")
    assert "line 2, field '(line)': not UTF-8 (invalid continuation byte at byte 46)" in out.stderr
    assert "line 3, field 'messages[0].role': unknown role 'bot'" in out.stderr
    assert not layout.prompts_dir.exists()


@pytest.mark.parametrize("argv, message", [
    (["add-dataset", "nowhere.jsonl"], "prompt file nowhere.jsonl does not exist"),
    (["add-dataset", "data.csv"], "a prompt file ends in .jsonl, .jsonl.gz or .parquet"),
    (["add-dataset", "x.jsonl", "--name", "bad name"], "not usable as a partition key"),
    (["add-dataset", "x.jsonl", "--map", "question"], "expected KEY=COLUMN"),
    (["backfill", "bad name"], "not usable as a partition key"),
])
def test_user_input_errors_exit_2_with_one_line(layout, capsys, argv, message):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_add_parquet_with_a_column_map_then_replace_it(tmp_path, layout, instance_home, capsys):
    src = tmp_path / "alpaca.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"task": "t1", "instruction": "Add 2 and 3.", "input": ""},
        {"task": "t2", "instruction": "Translate to French:", "input": "Good night"},
    ]), src)
    assert cli.main(["add-dataset", str(src)]) == 2
    assert "neither a 'messages'" in capsys.readouterr().err

    assert cli.main(["add-dataset", str(src), "--map", "user=instruction+input", "--map", "id=task"]) == 0
    assert "dataset 'alpaca': 2 prompts (0 bad rows skipped)" in capsys.readouterr().out
    assert layout.prompt_source("alpaca") == layout.prompt_file("alpaca", ".parquet")
    assert layout.prompt_source("alpaca").read_bytes() == src.read_bytes()
    opts = ReadOptions.load(layout.prompt_read_options("alpaca"))
    assert opts.columns.user == ["instruction", "input"] and opts.columns.id == "task"
    assert _partitions(instance_home) == ["alpaca"]

    again = write_jsonl(tmp_path / "alpaca.jsonl", small_prompts(2))
    assert cli.main(["add-dataset", str(again)]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert cli.main(["add-dataset", str(again), "--force"]) == 0
    assert [p.name for p in layout.prompt_sources("alpaca")] == ["alpaca.jsonl"]
    assert not layout.prompt_read_options("alpaca").exists()  # the new file is read without the old map


def test_skip_invalid_and_drop_final_assistant_are_kept_for_the_asset(tmp_path, layout, instance_home, capsys):
    src = tmp_path / "chats.jsonl.gz"
    rows = [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
            {"conversations": [{"from": "alien", "value": "?"}]},
            {"messages": [{"role": "user", "content": "Q"}]}]
    with gzip.open(src, "wt", encoding="utf-8") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in rows))
    assert cli.main(["add-dataset", str(src), "--skip-invalid", "--drop-final-assistant"]) == 0
    out = capsys.readouterr()
    assert "dataset 'chats': 2 prompts (1 bad rows skipped, 1 final assistant turns dropped)" in out.out
    assert "line 2, field 'conversations[0].from'" in out.err
    assert ReadOptions.load(layout.prompt_read_options("chats")) == ReadOptions(skip_invalid_rows=True,
                                                                                final_assistant="drop")
    assert layout.prompt_source("chats").name == "chats.jsonl.gz"


def test_the_sensor_sees_every_prompt_file_format(layout):
    write_jsonl(layout.prompt_file("plain"), small_prompts(1))
    with gzip.open(layout.prompt_file("zipped", ".jsonl.gz"), "wt") as fh:
        fh.write(json.dumps(small_prompts(1)[0]) + "\n")
    pq.write_table(pa.Table.from_pylist(small_prompts(1)), layout.prompt_file("columnar", ".parquet"))
    (layout.prompts_dir / ".plain2.jsonl.tmp-123").write_text("half a copy")
    layout.prompt_table("plain").parent.mkdir(parents=True)
    layout.prompt_table("plain").write_bytes(b"a table, not a prompt file")
    with dg.instance_for_test() as instance:
        ctx = dg.build_sensor_context(instance=instance, definitions=defs, resources={"storage": StorageResource()})
        result = prompt_files_sensor(ctx)
    assert [r.partition_keys for r in result.dynamic_partitions_requests] == [["columnar", "plain", "zipped"]]
    assert sorted(r.partition_key for r in result.run_requests) == ["columnar", "plain", "zipped"]
