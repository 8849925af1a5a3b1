"""The serving stage's Dagster-free parts against a serve role without a server
(``tests/support/fake_serve.py``): prompt readers and their errors, the sweep's plan, figures from a
timing stream, the journal's resume, the best setting, contamination, provenance and reuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_assets.engines.stream import Streamed
from eagle3_assets.serving.bench_prompts import (
    BenchPromptError,
    bundled_prompts,
    prompt_set_hash,
    read_bench_file,
    take_per_category,
)
from eagle3_assets.serving.contamination import contaminated
from eagle3_assets.serving.journal import Journal
from eagle3_assets.serving.plan import chain, plan_cells, settings_for
from eagle3_assets.serving.results import ALL, best_settings, mismatches, rows
from eagle3_assets.serving.sweep import Bench, SweepSpec, run_sweep
from eagle3_assets.serving.timing import Timed, batch_figures
from tests.support.fake_serve import FakeServe


def _write(path: Path, rows_) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows_))
    return path


def test_the_bundled_set_covers_every_category_with_real_text():
    prompts = bundled_prompts()
    cats = {p.category for p in prompts}
    assert cats == {"chat", "coding", "math", "reasoning", "extraction", "multi-turn", "agentic", "long-input"}
    agentic = [p for p in prompts if p.category == "agentic"]
    assert all(p.tools and any(m["role"] == "tool" for m in p.messages) for p in agentic)
    assert all(any(m.get("tool_calls") for m in p.messages) for p in agentic)
    assert all(sum(m["role"] == "user" for m in p.messages) >= 2 for p in prompts if p.category == "multi-turn")
    assert min(len(p.messages[0]["content"]) for p in prompts if p.category == "long-input") > 2000
    assert [p.category for p in take_per_category(prompts, 1)] == list(dict.fromkeys(p.category for p in prompts))


def test_mt_bench_speed_bench_and_project_rows_are_read(tmp_path):
    path = _write(tmp_path / "mine.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now another."]},
        {"question_id": "sb-1", "category": "coding", "sub_category": "python", "turns": ["Sort a list."],
         "source": "x", "src_id": "1", "difficulty": "easy", "multiturn": False},
        {"id": "p1", "category": "math", "messages": [{"role": "user", "content": "2+2?"}]},
    ])
    got = read_bench_file(path)
    assert [(p.prompt_id, p.category, p.messages[0]["content"]) for p in got] == [
        ("81", "writing", "Write a haiku."), ("sb-1", "coding", "Sort a list."), ("p1", "math", "2+2?")]
    assert {p.source for p in got} == {"mine.jsonl"}


@pytest.mark.parametrize("row, field, words", [
    ({"question_id": 1, "category": "poetry", "turns": ["x"]}, "category", "unknown category 'poetry'"),
    ({"question_id": 1, "turns": ["x"]}, "category", "missing"),
    ({"question_id": 1, "category": "math", "turns": []}, "turns", "non-empty list"),
    ({"category": "math", "turns": ["x"]}, "question_id", "missing"),
    ({"id": "a", "category": "math", "messages": [{"role": "robot", "content": "x"}]}, "messages", ""),
    ("{not json", "(row)", "not valid JSON"),
])
def test_a_bad_row_is_named_by_file_row_and_field(tmp_path, row, field, words):
    path = _write(tmp_path / "bad.jsonl", [{"question_id": 0, "category": "math", "turns": ["ok"]}, row])
    with pytest.raises(BenchPromptError) as e:
        read_bench_file(path)
    msg = str(e.value)
    assert str(path) in msg and "row 2" in msg and field.split("[")[0] in msg and words in msg


def test_duplicate_ids_and_extra_categories(tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"question_id": 1, "category": "poetry", "turns": ["a"]},
                                         {"question_id": 1, "category": "poetry", "turns": ["b"]}])
    with pytest.raises(BenchPromptError, match="row 2.*duplicate id '1'"):
        read_bench_file(path, ("poetry",))


def test_the_plan_puts_the_baseline_first_and_notes_trees_an_engine_cannot_take():
    settings, notes = settings_for([3, 1, 3], [(3, 4, 8)], takes_trees=False)
    assert [s.label for s in settings] == ["baseline", "chain 1", "chain 3"]
    assert notes == ["tree 3x4/8: the engine drafts chains only"]
    settings, notes = settings_for([2], [(3, 4, 8)], takes_trees=True)
    assert [s.label for s in settings] == ["baseline", "chain 2", "tree 3x4/8"] and not notes
    assert chain(3).draft_tokens == 4
    cells = plan_cells("e", settings[:2], [4, 1], ["math", "chat"])
    assert [c.key for c in cells][:3] == ["e|baseline|c1|math", "e|baseline|c1|chat", "e|baseline|c4|math"]
    with pytest.raises(ValueError):
        plan_cells("e", settings, [0], ["x"])


def test_figures_from_a_timing_stream():
    a = Timed("a", sent=10.0, arrivals=[10.5, 10.7, 10.9], output_ids=[1, 2, 3, 4, 5])  # 5 tokens, 3 chunks
    b = Timed("b", sent=10.2, arrivals=[10.4, 11.0], output_ids=[7, 8])
    f = batch_figures([a, b])
    assert f["output_tokens"] == 7 and f["wall_s"] == pytest.approx(1.0)
    assert f["tokens_per_s"] == pytest.approx(7.0)
    assert f["ttft_s"] == pytest.approx((0.5 + 0.2) / 2)
    assert f["tpot_s"] == pytest.approx(((10.9 - 10.5) / 4 + (11.0 - 10.4) / 1) / 2)


def _bench(tmp_path, prompts=None) -> Bench:
    prompts = prompts or take_per_category(bundled_prompts(), 1)[:3]
    ids = [[10 + i, 20 + 3 * i, 7] * (i + 1) for i in range(len(prompts))]
    drafter = tmp_path / "drafter"
    (drafter / "fake").mkdir(parents=True, exist_ok=True)
    (drafter / "fake" / "config.json").write_text("{}")
    return Bench(prompts, ids, prompt_set_hash(prompts, ids), tmp_path, drafter, "target-id", "test machine")


def test_a_server_that_dies_is_restarted_and_measured_cells_are_kept_then_reused(tmp_path):
    role = FakeServe()
    role.die_after = 4  # a warm-up and the baseline's three c1 cells, then it dies in its first c2 cell
    bench, spec = _bench(tmp_path), SweepSpec(chains=[2], concurrency=[1, 2], max_new_tokens=6)
    journal = Journal(tmp_path / "j.jsonl")
    out = run_sweep(bench, spec, journal, roles={"fake": role}, log=lambda m: None)
    assert out.restarts == 1 and role.started == [0, 0, 2]
    assert out.measured == 12 and len(out.entries) == 12 and not out.skipped
    # first server: warm-up, three c1 cells, the request it died on (its c2 cell's second request is
    # cancelled unless it had started); then warm-up + three c2 cells of two requests; chain 2: 1 + 3 + 6
    assert role.requests in (5 + 7 + 10, 6 + 7 + 10)
    lines = (tmp_path / "j.jsonl").read_text().splitlines()
    assert len(lines) == 12 and len({json.loads(x)["key"] for x in lines}) == 12
    requests = role.requests
    (tmp_path / "j.jsonl").write_text("\n".join(lines) + '\n{"key": "torn')  # a crash mid-write
    again = run_sweep(bench, spec, Journal(tmp_path / "j.jsonl"), roles={"fake": role}, log=lambda m: None)
    assert again.measured == 0 and again.reused == 12 and role.started == [0, 0, 2] and role.requests == requests
    (bench.drafter_dir / "fake" / "config.json").write_text('{"changed": 1}')  # another export: everything again
    changed = run_sweep(bench, spec, Journal(tmp_path / "j.jsonl"), roles={"fake": role}, log=lambda m: None)
    assert changed.measured == 12 and changed.reused == 0


def test_missing_and_unservable_engines_are_reported_not_raised(tmp_path):
    gone, refuses = FakeServe(), FakeServe()
    gone.missing_reason, refuses.problem_reason = "no environment at /x", "cannot serve an MLA drafter"
    out = run_sweep(_bench(tmp_path), SweepSpec(chains=[1], concurrency=[1]), Journal(tmp_path / "j.jsonl"),
                    roles={"gone": gone, "fake": refuses}, log=lambda m: None)
    assert out.missing == {"gone": "no environment at /x"} and out.skipped == {"fake": "cannot serve an MLA drafter"}
    assert not out.entries and not gone.started and not refuses.started


def test_rows_speedups_mismatches_and_the_best_setting(tmp_path):
    role = FakeServe()
    bench = _bench(tmp_path)
    role.corrupt = {(3, len(bench.ids[1]))}  # chain 3 changes the second prompt's output
    out = run_sweep(bench, SweepSpec(chains=[2, 3], concurrency=[1]), Journal(tmp_path / "j.jsonl"),
                    roles={"fake": role}, log=lambda m: None)
    bad = mismatches(out.entries)
    assert [(m["setting"], m["prompt"], m["first_difference_at"]) for m in bad] == [
        ("chain 3", bench.prompts[1].prompt_id, 2)]
    table = rows(out.entries)
    pooled = {r["setting"]: r for r in table if r["category"] == ALL}
    assert pooled["baseline"]["speedup"] == pytest.approx(1.0) and pooled["baseline"]["acceptance_length"] is None
    assert pooled["chain 2"]["acceptance_length"] == 2.0  # 6 tokens in 3 steps of 2 drafts, 1 accepted each
    assert not pooled["chain 3"]["outputs_equal_baseline"] and pooled["chain 2"]["outputs_equal_baseline"]
    best = best_settings(table)
    assert best["fake"]["1"]["setting"] == "chain 2"  # chain 3 is excluded, whatever its speed
    # a figure that lost its provenance is not shown
    out.entries[0]["provenance"] = {**out.entries[0]["provenance"], "machine": ""}
    assert len(rows(out.entries)) == len(table) - 1


def test_a_benchmark_prompt_in_the_training_data_is_named(tmp_path):
    bench = _bench(tmp_path)
    train = {tuple(bench.ids[2]): "qa"}
    assert contaminated(bench.prompts, bench.ids, train) == [
        {"prompt": bench.prompts[2].prompt_id, "category": bench.prompts[2].category, "source": bench.prompts[2].source,
         "match": "prompt", "training_dataset": "qa"}]


def test_streamed_events_of_both_engines_are_parsed():
    from eagle3_assets.engines.sglang.serving import _parse as sglang_parse
    from eagle3_assets.engines.vllm.serving import _parse as vllm_parse

    assert vllm_parse({"choices": [{"text": " Ita", "token_ids": [28, 7158]}]}, []) == ([28, 7158], None)
    assert vllm_parse({"choices": [], "usage": {}}, [1]) == ([], None)
    so_far = [5, 6]
    assert sglang_parse({"output_ids": [5, 6, 7, 8], "meta_info": {"x": 1}}, so_far) == ([7, 8], {"x": 1})
    assert sglang_parse({"output_ids": [9]}, so_far) == ([9], None)  # --stream-output: only the new ones
    assert isinstance(Streamed(sent=0.0), Streamed)


def test_a_level_above_a_categorys_prompts_is_reached_and_every_copy_checked(tmp_path):
    role = FakeServe()
    bench = _bench(tmp_path)  # one prompt per category
    out = run_sweep(bench, SweepSpec(chains=[2], concurrency=[1, 3]), Journal(tmp_path / "j.jsonl"),
                    roles={"fake": role}, log=lambda m: None)
    sent = {(e["label"], e["concurrency"]): e["figures"]["requests"] for e in out.entries}
    assert set(sent.values()) == {1, 3} and all(n == c for (_, c), n in sent.items())
    assert role.requests == 2 * (1 + 3 * 1 + 3 * 3)  # per server: warm-up, c1 cells, c3 cells of three
    c3 = next(e for e in out.entries if e["concurrency"] == 3 and e["label"] == "chain 2")
    pid = next(iter(c3["outputs"]))
    assert len(c3["copy_outputs"][pid]) == 2 and not mismatches(out.entries)
    c3["copy_outputs"][pid][1] = [*c3["outputs"][pid][:4], 96]  # one copy of three answered otherwise
    bad = mismatches(out.entries)
    assert [(m["setting"], m["concurrency"], m["prompt"], m["first_difference_at"]) for m in bad] == [
        ("chain 2", 3, pid, 4)]
