import json

import pytest

from eagle3_assets.prompts.reader import PromptFileError, content_hash_id, read_prompt_file
from tests.conftest import write_jsonl


def test_openai_and_sharegpt_rows_normalize(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [
        {"id": "a", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
        {"conversations": [{"from": "human", "value": "Hello"}, {"from": "gpt", "value": "Hey"},
                           {"from": "human", "value": "Bye?"}]},
        {"id": 7, "messages": [{"role": "user", "content": "Numbers as ids"}]},
    ])
    parsed = read_prompt_file(path)
    assert [p.prompt_id for p in parsed.prompts][0] == "a"
    assert parsed.prompts[2].prompt_id == "7"
    assert parsed.prompts[1].messages == [
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hey"}, {"role": "user", "content": "Bye?"},
    ]
    assert parsed.prompts[1].prompt_id == content_hash_id(parsed.prompts[1].messages)


def test_content_hash_ids_are_stable_and_distinct():
    a = [{"role": "user", "content": "x"}]
    assert content_hash_id(a) == content_hash_id(json.loads(json.dumps(a)))
    assert content_hash_id(a) != content_hash_id([{"role": "user", "content": "y"}])


@pytest.mark.parametrize("row, line_field, reason", [
    ('{"messages": [{"role": "user", "content": "ok"}', "(line)", "not valid JSON"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "messages[1]",
     "last turn must be the user's"),
    ({"messages": [{"role": "wizard", "content": "q"}]}, "messages[0].role", "unknown role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "must be a string"),
    ({"conversations": [{"from": "alien", "value": "q"}]}, "conversations[0].from", "unknown speaker"),
    ({"prompt": "no messages here"}, "messages", "neither 'messages'"),
    ({"id": "", "messages": [{"role": "user", "content": "q"}]}, "id", "non-empty"),
    ({"messages": [{"role": "user", "content": "   "}]}, "messages[0]", "empty"),
])
def test_bad_rows_name_file_line_and_field(tmp_path, row, line_field, reason):
    good = {"id": "g", "messages": [{"role": "user", "content": "fine"}]}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, row])
    with pytest.raises(PromptFileError) as e:
        read_prompt_file(path)
    assert e.value.line == 2 and e.value.field == line_field
    assert str(path) in str(e.value) and "line 2" in str(e.value) and reason in str(e.value)


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


def test_file_without_usable_rows_and_non_utf8(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n')
    with pytest.raises(PromptFileError, match="line 1.*not UTF-8"):
        read_prompt_file(path)
    with pytest.raises(PromptFileError, match="no usable prompt rows"):
        read_prompt_file(path, skip_invalid=True)


def test_bundled_demo_datasets_are_valid():
    from eagle3_assets.demo import DEMO_PROMPTS

    files = sorted(DEMO_PROMPTS.glob("*.jsonl"))
    assert len(files) >= 3
    for f in files:
        assert len(read_prompt_file(f).prompts) >= 30
