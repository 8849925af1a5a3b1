"""Prompt files as users have them: JSONL, JSONL.gz and Parquet; OpenAI, ShareGPT and mapped columns.

Every file here is written by the test itself. The files are tens of rows; the reader streams, so
the same code path serves a 10 GB JSONL (``benchmarks/prompts.py`` measures that side).
"""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_assets.errors import UserInputError
from eagle3_assets.paths import DataLayout
from eagle3_assets.prompts.options import ColumnMap, ReadOptions, parse_column_map
from eagle3_assets.prompts.problems import PromptFileError
from eagle3_assets.prompts.reader import PromptReader, content_hash_id, read_prompt_file
from tests.conftest import write_jsonl

GOOD = {"id": "g", "messages": [{"role": "user", "content": "fine"}]}


def write_parquet(path, rows, schema=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def test_openai_and_sharegpt_rows_normalize(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [
        {"id": "a", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
        {"conversations": [{"from": "human", "value": "Hello"}, {"from": "gpt", "value": "Hey"},
                           {"from": "human", "value": "Bye?"}]},
        {"id": 7, "messages": [{"role": "user", "content": "Numbers as ids"}]},
        {"conversations": [{"role": "user", "content": "ShareGPT with OpenAI keys"}]},
        {"messages": [{"role": "developer", "content": "Terse."}, {"role": "user", "content": "Developer is system"}]},
        {"id": 8.0, "messages": [{"role": "user", "content": "An integer id that went through pandas"}]},
    ])
    parsed = read_prompt_file(path)
    assert [p.prompt_id for p in parsed.prompts][0] == "a"
    assert parsed.prompts[2].prompt_id == "7"
    assert parsed.prompts[1].messages == [
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hey"}, {"role": "user", "content": "Bye?"},
    ]
    assert parsed.prompts[1].prompt_id == content_hash_id(parsed.prompts[1].messages)
    assert parsed.prompts[3].messages == [{"role": "user", "content": "ShareGPT with OpenAI keys"}]
    assert parsed.prompts[4].messages[0] == {"role": "system", "content": "Terse."}
    assert parsed.prompts[5].prompt_id == "8"


def test_content_hash_ids_are_stable_and_distinct():
    a = [{"role": "user", "content": "x"}]
    assert content_hash_id(a) == content_hash_id(json.loads(json.dumps(a)))
    assert content_hash_id(a) != content_hash_id([{"role": "user", "content": "y"}])


def test_openai_text_parts_are_joined_and_other_parts_refused(tmp_path):
    parts = [{"type": "text", "text": "Describe this:"}, {"type": "text", "text": "a red square."}]
    path = write_jsonl(tmp_path / "parts.jsonl", [
        {"id": "t", "messages": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                                 {"role": "user", "content": parts}]},
        {"id": "i", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in the picture?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
    ])
    with pytest.raises(PromptFileError) as e:
        read_prompt_file(path)
    (problem,) = e.value.problems
    assert (problem.line, problem.field) == (2, "messages[0].content[1].type")
    assert "'image_url' cannot be used: only text parts" in problem.reason
    assert e.value.counts == {"non-text content part": 1}
    ok = read_prompt_file(path, skip_invalid=True).prompts
    assert ok[0].messages == [{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "Describe this:\na red square."}]


@pytest.mark.parametrize("row, line_field, reason", [
    ('{"messages": [{"role": "user", "content": "ok"}', "(line)", "not valid JSON"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "messages[1]",
     "last turn must be the user's"),
    ({"messages": [{"role": "wizard", "content": "q"}]}, "messages[0].role", "unknown role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "must be a string"),
    ({"messages": [{"role": "user", "content": ["loose string"]}]}, "messages[0].content[0]", "{type, text}"),
    ({"conversations": [{"from": "alien", "value": "q"}]}, "conversations[0].from", "unknown speaker"),
    ({"prompt": "no messages here"}, "messages", "neither 'messages'"),
    ({"id": "", "messages": [{"role": "user", "content": "q"}]}, "id", "non-empty"),
    ({"id": 1.5, "messages": [{"role": "user", "content": "q"}]}, "id", "non-empty string or integer"),
    ('[{"messages": []}]', "(line)", "JSONL holds one object per line"),
    ({"messages": [{"role": "user", "content": "   "}]}, "messages[0]", "empty"),
])
def test_bad_rows_name_file_line_and_field(tmp_path, row, line_field, reason):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, row])
    with pytest.raises(PromptFileError) as e:
        read_prompt_file(path)
    (problem,) = e.value.problems
    assert problem.line == 2 and problem.field == line_field and reason in problem.reason
    assert str(path) in str(e.value) and f"line 2, field '{line_field}'" in str(e.value)


def test_every_bad_row_is_reported_in_one_summary(tmp_path):
    """The issue's eight bad rows: one pass, one summary with counts per reason and the rows."""
    bad = [
        '{"messages": [{"role": "user", "content": "cut off"}',
        {"messages": [{"role": "bot", "content": "q"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"messages": [{"role": "user", "content": 5}]},
        {"prompt": "no messages"},
        {"id": "g", "messages": [{"role": "user", "content": "same id as line 1"}]},
        '["a list"]',
        {"messages": [{"role": "user", "content": ""}]},
    ]
    path = write_jsonl(tmp_path / "eight.jsonl", [GOOD, *bad, {"messages": [{"role": "user", "content": "ok too"}]}])
    with pytest.raises(PromptFileError) as e:
        read_prompt_file(path)
    err = e.value
    assert err.log.total == 8 and err.rows == 10
    assert [p.line for p in err.problems] == list(range(2, 10))
    assert err.counts["duplicate id"] == 1 and err.counts["not valid JSON"] == 1 and sum(err.counts.values()) == 8
    text = str(err)
    assert text.startswith(f"{path}: 8 of 10 rows cannot be used")
    assert "line 7, field 'id': duplicate prompt id 'g' (first seen on line 1)" in text
    assert "--skip-invalid" in text


def test_a_summary_counts_every_row_but_quotes_only_the_first(tmp_path):
    rows = [GOOD] + ['{"broken' for _ in range(25)] + [{"messages": [{"role": "bot", "content": "x"}]}]
    path = write_jsonl(tmp_path / "many.jsonl", rows)
    with pytest.raises(PromptFileError) as e:
        read_prompt_file(path)
    assert e.value.counts == {"not valid JSON": 25, "unknown role": 1}
    assert len(e.value.problems) == 10 and "rows (the first 10):" in str(e.value)
    assert "  25  not valid JSON" in str(e.value)


def test_a_byte_order_mark_is_tolerated_and_utf16_named(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\r\n" + json.dumps(
        {"id": "h", "messages": [{"role": "user", "content": "windows line ends"}]}).encode() + b"\r\n")
    assert [p.prompt_id for p in read_prompt_file(path).prompts] == ["g", "h"]
    utf16 = tmp_path / "notepad.jsonl"
    utf16.write_bytes(json.dumps(GOOD).encode("utf-16"))
    with pytest.raises(PromptFileError, match="the file is UTF-16; save it as UTF-8"):
        read_prompt_file(utf16)


def test_duplicate_ids_and_skip_mode(tmp_path):
    rows = [{"id": "x", "messages": [{"role": "user", "content": "one"}]},
            {"id": "x", "messages": [{"role": "user", "content": "two"}]},
            "not json",
            {"id": "y", "messages": [{"role": "user", "content": "three"}]}]
    path = write_jsonl(tmp_path / "dup.jsonl", rows)
    with pytest.raises(PromptFileError, match="duplicate prompt id 'x' .first seen on line 1"):
        read_prompt_file(path)
    parsed = read_prompt_file(path, skip_invalid=True)
    assert [p.prompt_id for p in parsed.prompts] == ["x", "y"]
    assert [(e.line, e.field) for e in parsed.skipped] == [(2, "id"), (3, "(line)")]
    assert parsed.skipped_count == 2 and parsed.rows == 4


def test_file_without_usable_rows_and_non_utf8(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n')
    with pytest.raises(PromptFileError, match="line 1, field '.line.': not UTF-8"):
        read_prompt_file(path)
    with pytest.raises(PromptFileError, match="no usable prompt rows"):
        read_prompt_file(path, skip_invalid=True)


def test_gzip_jsonl_is_read_and_a_broken_one_named(tmp_path):
    rows = [GOOD, {"conversations": [{"from": "human", "value": "zipped"}]}]
    path = tmp_path / "zipped.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        fh.write("\ufeff" + "\n".join(json.dumps(r) for r in rows) + "\n")
    assert [p.messages[-1]["content"] for p in read_prompt_file(path).prompts] == ["fine", "zipped"]
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(path.read_bytes()[:-12])
    with pytest.raises(PromptFileError, match="cut.jsonl.gz: not a complete gzip file"):
        read_prompt_file(cut)
    plain = tmp_path / "plain.jsonl.gz"
    plain.write_text(json.dumps(GOOD))
    with pytest.raises(PromptFileError, match="not a complete gzip file"):
        read_prompt_file(plain)


def test_parquet_rows_in_openai_sharegpt_and_part_form(tmp_path):
    """The shapes dataset hubs export: list<struct> columns, nulls where a struct field is absent."""
    path = write_parquet(tmp_path / "hub.parquet", [
        {"id": "p1", "messages": [{"role": "user", "content": "From parquet"}], "conversations": None},
        {"id": "p2", "messages": None, "conversations": [{"from": "human", "value": "ShareGPT in parquet"}]},
        {"id": "p3", "messages": [{"role": "assistant", "content": "no question"}], "conversations": None},
        {"id": "p4", "messages": [{"role": "user", "content": "Another"}], "conversations": None},
    ])
    with pytest.raises(PromptFileError) as e:
        read_prompt_file(path)
    (problem,) = e.value.problems
    assert (problem.unit, problem.line, problem.field) == ("row", 3, "messages[0]")
    assert "row 3, field 'messages[0]'" in str(e.value)
    ok = read_prompt_file(path, skip_invalid=True).prompts
    assert [(p.prompt_id, p.line) for p in ok] == [("p1", 1), ("p2", 2), ("p4", 4)]

    parts = pa.schema([("id", pa.int64()), ("messages", pa.list_(pa.struct([
        ("role", pa.string()), ("content", pa.list_(pa.struct([("type", pa.string()), ("text", pa.string())])))])))])
    parts_path = write_parquet(tmp_path / "parts.parquet", [
        {"id": 11, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
    ], schema=parts)
    (p,) = read_prompt_file(parts_path).prompts
    assert p.prompt_id == "11" and p.messages == [{"role": "user", "content": "a\nb"}]


def test_parquet_without_prompt_columns_or_not_parquet_at_all(tmp_path):
    path = write_parquet(tmp_path / "alpaca.parquet", [{"instruction": "Add 2 and 3.", "input": "", "output": "5"}])
    with pytest.raises(PromptFileError, match="neither a 'messages' .* column; the file has: instruction, input, output"):
        read_prompt_file(path)
    bogus = tmp_path / "bogus.parquet"
    bogus.write_text("not parquet")
    with pytest.raises(PromptFileError, match="bogus.parquet: not a readable Parquet file"):
        read_prompt_file(bogus)


def test_a_column_map_reads_instruction_datasets(tmp_path):
    cols = parse_column_map(["user=instruction+input", "id=uid,system=sys"])
    assert cols == ColumnMap(user=["instruction", "input"], id="uid", system="sys")
    rows = [
        {"uid": "a1", "instruction": "Translate to French.", "input": "Good morning", "sys": "You translate."},
        {"uid": "a2", "instruction": "Name a prime number.", "input": "", "sys": None},
        {"uid": "a3", "instruction": "", "input": None},
    ]
    opts = ReadOptions(columns=cols)
    for path in (write_jsonl(tmp_path / "alpaca.jsonl", rows), write_parquet(tmp_path / "alpaca.parquet", rows)):
        with pytest.raises(PromptFileError) as e:
            read_prompt_file(path, options=opts)
        (problem,) = e.value.problems
        assert (problem.line, problem.field, problem.kind) == (3, "input", "empty user turn")
        a1, a2 = read_prompt_file(path, options=opts, skip_invalid=True).prompts
        assert a1.prompt_id == "a1" and a1.messages == [
            {"role": "system", "content": "You translate."},
            {"role": "user", "content": "Translate to French.\n\nGood morning"}]
        assert a2.messages == [{"role": "user", "content": "Name a prime number."}]
    missing = write_jsonl(tmp_path / "missing.jsonl", [{"uid": "b", "instruction": "hi"}])
    with pytest.raises(PromptFileError, match="line 1, field 'input': missing .the column map names it."):
        read_prompt_file(missing, options=opts)
    with pytest.raises(PromptFileError, match="no column 'sys', 'input'|no column 'input', 'sys'"):
        read_prompt_file(write_parquet(tmp_path / "short.parquet", [{"uid": "c", "instruction": "x"}]), options=opts)


@pytest.mark.parametrize("spec, message", [
    ("user", "expected KEY=COLUMN"),
    ("prompt=text", "expected KEY=COLUMN"),
    ("id=a+b", "only 'user' joins several columns"),
    ("user=a,user=b", "names 'user' twice"),
])
def test_bad_column_maps_are_user_errors(spec, message):
    with pytest.raises(UserInputError, match=message):
        parse_column_map([spec])


def test_final_assistant_turns_can_become_the_prompt(tmp_path):
    path = write_jsonl(tmp_path / "chats.jsonl", [
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]},
        {"messages": [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
                      {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]},
        {"messages": [{"role": "user", "content": "already a prompt"}]},
        {"messages": [{"role": "assistant", "content": "a reply to nothing"}]},
    ])
    with pytest.raises(PromptFileError, match="final_assistant: drop"):
        read_prompt_file(path)
    reader = PromptReader(path, ReadOptions(final_assistant="drop"), skip_invalid=True)
    got = [p.messages for p in reader]
    reader.finish()
    assert got[0] == [{"role": "user", "content": "Hi"}]
    assert got[1][-1] == {"role": "user", "content": "Q2"} and len(got[1]) == 3
    assert reader.final_assistant_dropped == 2 and reader.skipped == 1
    assert reader.log.examples[0].reason == "has no user turn, only the assistant's"


def test_read_options_round_trip_and_a_bad_file_is_named(tmp_path):
    opts = ReadOptions(columns=ColumnMap(user=["question"]), final_assistant="drop")
    path = tmp_path / "q.read.json"
    opts.save(path)
    assert json.loads(path.read_text()) == {"columns": {"user": ["question"]}, "final_assistant": "drop"}
    assert ReadOptions.load(path) == opts
    assert ReadOptions.load(tmp_path / "absent.read.json").is_default
    path.write_text('{"columns": {"usr": ["question"]}}')
    with pytest.raises(UserInputError, match="q.read.json: not valid read options"):
        ReadOptions.load(path)


def test_prompt_files_with_any_suffix_are_datasets(tmp_path):
    layout = DataLayout(tmp_path)
    write_jsonl(layout.prompt_file("a"), [GOOD])
    with gzip.open(layout.prompt_file("b", ".jsonl.gz"), "wt") as fh:
        fh.write(json.dumps(GOOD) + "\n")
    write_parquet(layout.prompt_file("c", ".parquet"), [GOOD])
    (layout.prompts_dir / "notes.txt").write_text("not a dataset")
    (layout.prompts_dir / "c.read.json").write_text("{}")
    assert layout.datasets_on_disk() == ["a", "b", "c"]
    assert layout.prompt_source("b").name == "b.jsonl.gz" and layout.prompt_source("new").name == "new.jsonl"
    assert layout.prompt_table("c") == tmp_path / "prompts" / "tables" / "c.parquet"
    write_jsonl(layout.prompt_file("c"), [GOOD])
    with pytest.raises(UserInputError, match="dataset 'c' has 2 prompt files .c.jsonl, c.parquet."):
        layout.prompt_source("c")


def test_a_prompt_table_left_by_an_older_version_is_not_a_second_file(tmp_path):
    from eagle3_assets.prompts.rows import Prompt
    from eagle3_assets.prompts.table import write_prompt_table

    layout = DataLayout(tmp_path)
    write_jsonl(layout.prompt_file("old"), [GOOD])
    legacy = pa.table({"prompt_id": ["g"], "messages": ["[]"], "turns": pa.array([1], pa.int32()),
                       "line": pa.array([1], pa.int32())})
    pq.write_table(legacy, layout.prompts_dir / "old.parquet")
    assert layout.datasets_on_disk() == ["old"] and layout.prompt_source("old").name == "old.jsonl"
    write_prompt_table([Prompt("g", GOOD["messages"], 1)], layout.prompt_table("old"))
    assert layout.datasets_on_disk() == ["old"]


def test_bundled_demo_datasets_are_valid():
    from eagle3_assets.demo import DEMO_PROMPTS

    files = sorted(DEMO_PROMPTS.glob("*.jsonl"))
    assert len(files) >= 3
    for f in files:
        assert len(read_prompt_file(f).prompts) >= 30
