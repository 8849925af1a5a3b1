import pytest

from eagle3_assets.engines.http.samples import SamplingSettings, sample_id
from eagle3_assets.generation.budget import TokenBudget
from eagle3_assets.generation.response_store import CorruptResponseFile, ResponseStore


def row(sid, tokens=3, source="local"):
    return {"sample_id": sid, "dataset": "d", "prompt_id": sid, "source": source, "completion_tokens": tokens}


def test_writer_appends_whole_lines_and_resume_sees_all_sources(tmp_path):
    store = ResponseStore(tmp_path / "d")
    with store.writer("local") as w:
        w.write_batch([row("a"), row("b")])
    with store.writer("openrouter") as w:
        w.write_batch([row("c", source="openrouter")])
    assert store.finished_ids() == {"a", "b", "c"}
    assert [r["sample_id"] for r in store.rows(["local"])] == ["a", "b"]


def test_torn_last_line_is_ignored_then_cut_before_the_next_append(tmp_path):
    store = ResponseStore(tmp_path / "d")
    with store.writer("local") as w:
        w.write_batch([row("a")])
    with store.path("local").open("ab") as fh:
        fh.write(b'{"sample_id": "b", "datas')  # a crash mid-write
    assert store.finished_ids() == {"a"}
    assert store.torn_bytes("local") > 0
    with store.writer("local") as w:
        w.write_batch([row("b")])
    assert [r["sample_id"] for r in store.rows()] == ["a", "b"]
    assert store.path("local").read_bytes().endswith(b"\n")


def test_corrupt_complete_line_names_file_and_line(tmp_path):
    store = ResponseStore(tmp_path / "d")
    with store.writer("local") as w:
        w.write_batch([row("a")])
    with store.path("local").open("ab") as fh:
        fh.write(b"garbage\n")
    with pytest.raises(CorruptResponseFile, match=r"local.jsonl, line 2"):
        store.rows()


def test_budget_reserves_then_settles_and_is_never_exceeded():
    b = TokenBudget(limit=100, used=40)
    assert b.try_reserve(50) and not b.try_reserve(20)
    b.settle(50, 12)
    assert (b.used, b.reserved, b.remaining) == (52, 0, 48)
    with pytest.raises(ValueError):
        b.try_reserve(10) and b.settle(10, 11)


def test_sample_id_ignores_backend_and_seed_when_greedy():
    greedy_a = SamplingSettings(target="m", seed=1)
    greedy_b = SamplingSettings(target="m", seed=2)
    assert sample_id("d", "p", greedy_a.identity(0)) == sample_id("d", "p", greedy_b.identity(0))
    hot_a = SamplingSettings(target="m", temperature=0.7, seed=1)
    hot_b = SamplingSettings(target="m", temperature=0.7, seed=2)
    assert sample_id("d", "p", hot_a.identity(0)) != sample_id("d", "p", hot_b.identity(0))
    assert sample_id("d", "p", greedy_a.identity(0)) != sample_id("d", "p", greedy_a.identity(1))
    assert sample_id("d", "p", greedy_a.identity(0)) != sample_id("e", "p", greedy_a.identity(0))
