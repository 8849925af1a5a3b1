"""MT-bench's later turns in the serving benchmark: one prompt per turn, asked after the target's own
greedy replies (checked against transformers' ``generate`` and the tokenizer's own chat template),
cached by what they depend on, part of the benchmark's hash (a stale journal is measured again), in
the contamination check, and bad input named by file, row and field. No server runs (the serve role
is ``tests/support/fake_serve.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle3_assets.serving.bench_prompts import BenchPromptError, prompt_set_hash, read_bench_file
from eagle3_assets.serving.contamination import contaminated
from eagle3_assets.serving.turns import ReplyModel, target_replies, with_later_turns
from eagle3_assets.target.embedded import Generation
from tests.support.fake_serve import FakeServe

ROWS = [{"question_id": 81, "category": "writing", "turns": ["Write one line about the sea.", "Now make it rhyme."]},
        {"question_id": 82, "category": "math", "turns": ["What is 2+3?", "Double it.", "Now add one."]},
        {"question_id": 83, "category": "math", "turns": ["What is 7-4?"]}]


def _write(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


class Scripted:
    """A stand-in model: each reply names how many calls came before it (so a regenerated reply differs)."""

    def __init__(self):
        self.loads = 0
        self.prompts: list[list[int]] = []

    def load(self):
        self.loads += 1
        return self

    def generate(self, prompts, *, max_new_tokens, temperature=0.0):
        assert temperature == 0.0
        out = []
        for ids in prompts:
            self.prompts.append(list(ids))
            out.append(Generation([1] * max_new_tokens, "length", f"reply {len(self.prompts)} of {max_new_tokens}"))
        return out


def _replies(rows, tok, model, tmp_path, **kw):
    precision = kw.pop("precision", "cpu float32")
    args = {"target_id": "t", "reply_tokens": 8, "cache": tmp_path / "turn_replies.json", "log": lambda m: None, **kw}
    return target_replies(rows, tok, ReplyModel(model.load, precision), **args)


def test_a_row_of_k_turns_is_k_prompts_rendered_as_the_chat_template_renders_them(tmp_path, target_tokenizer):
    rows = read_bench_file(_write(tmp_path / "mt.jsonl", ROWS))
    assert [p.turns for p in rows][0] == tuple(ROWS[0]["turns"]) and len(rows) == 3  # a row is read once
    answers, report = _replies(rows, target_tokenizer, Scripted(), tmp_path)
    prompts = with_later_turns(rows, answers)
    assert [(p.prompt_id, p.category) for p in prompts] == [
        ("81", "writing"), ("81/turn2", "writing"), ("82", "math"), ("82/turn2", "math"), ("82/turn3", "math"),
        ("83", "math")]
    assert report == {"rows": 2, "made": 2, "reused": 0, "reply_tokens": 8, "replies_cut": 3, "precision": "cpu float32"}
    a81, a82 = answers["81"], answers["82"]
    assert len(a81) == 1 and len(a82) == 2  # every turn but the last is answered
    by_id = {p.prompt_id: p for p in prompts}
    assert [dict(m) for m in by_id["82/turn3"].messages] == [
        {"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": a82[0]},
        {"role": "user", "content": "Double it."}, {"role": "assistant", "content": a82[1]},
        {"role": "user", "content": "Now add one."}]
    hf = target_tokenizer.tokenizer  # the independent record: the tokenizer's own template on those messages
    for p in prompts:
        want = hf.apply_chat_template([dict(m) for m in p.messages], tokenize=True, add_generation_prompt=True,
                                      return_dict=True)["input_ids"]
        assert p.render(target_tokenizer) == list(want)


def test_the_replies_are_the_targets_greedy_decode_turn_after_turn(tmp_path, embedded):
    import torch

    rows = read_bench_file(_write(tmp_path / "mt.jsonl", ROWS))
    answers, report = target_replies(rows, embedded.target_tokenizer, ReplyModel(lambda: embedded, "cpu float32"),
                                     target_id="t", reply_tokens=10, cache=tmp_path / "r.json", log=lambda m: None)
    hf = embedded.tokenizer
    for row in ROWS[:2]:
        messages, want = [], []
        for text in row["turns"][:-1]:  # transformers' generate on the conversation so far, one at a time
            messages.append({"role": "user", "content": text})
            ids = hf.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
            with torch.inference_mode():
                out = embedded.model.generate(**ids, max_new_tokens=10, do_sample=False, eos_token_id=embedded.stop_ids)
            reply = hf.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
            want.append(reply)
            messages.append({"role": "assistant", "content": reply})
        assert answers[str(row["question_id"])] == want
    assert report["made"] == 2 and all(answers[k] for k in answers)


def test_replies_are_cached_by_what_they_depend_on(tmp_path, target_tokenizer):
    rows = read_bench_file(_write(tmp_path / "mt.jsonl", ROWS))
    model = Scripted()
    first, _ = _replies(rows, target_tokenizer, model, tmp_path)
    again, report = _replies(rows, target_tokenizer, model, tmp_path)
    assert again == first and model.loads == 1 and report["reused"] == 2 and report["made"] == 0
    for change in ({"reply_tokens": 9}, {"target_id": "other"}, {"precision": "cuda bfloat16"}):
        made, report = _replies(rows, target_tokenizer, model, tmp_path, **change)
        assert report["made"] == 2 and made != first, change
    edited = [dict(ROWS[0], turns=[ROWS[0]["turns"][0], "Now make it shorter."]), *ROWS[1:]]
    rows2 = read_bench_file(_write(tmp_path / "mt.jsonl", edited))
    made, report = _replies(rows2, target_tokenizer, model, tmp_path)
    assert report["made"] == 1 and made["82"] == first["82"] and made["81"] != first["81"]  # only the edited row
    (tmp_path / "turn_replies.json").write_text('{"torn')
    _, report = _replies(rows, target_tokenizer, model, tmp_path)
    assert report["made"] == 2  # an unreadable cache is made again, never trusted


def _bench(tmp_path, prompts, tok):
    from eagle3_assets.serving.sweep import Bench

    drafter = tmp_path / "drafter"
    (drafter / "fake").mkdir(parents=True, exist_ok=True)
    (drafter / "fake" / "config.json").write_text("{}")
    ids = [p.render(tok) for p in prompts]
    return Bench(prompts, ids, prompt_set_hash(prompts, ids), tmp_path, drafter, "t", "test machine")


def test_new_replies_change_the_bench_hash_so_a_journal_is_measured_again(tmp_path, target_tokenizer):
    from eagle3_assets.serving.journal import Journal
    from eagle3_assets.serving.results import mismatches
    from eagle3_assets.serving.sweep import SweepSpec, run_sweep

    rows = read_bench_file(_write(tmp_path / "mt.jsonl", ROWS))
    model, spec, role = Scripted(), SweepSpec(chains=[2], concurrency=[1, 2], max_new_tokens=6), FakeServe()

    def sweep(**kw):
        answers, _ = _replies(rows, target_tokenizer, model, tmp_path, **kw)
        bench = _bench(tmp_path, with_later_turns(rows, answers), target_tokenizer)
        return bench, run_sweep(bench, spec, Journal(tmp_path / "j.jsonl"), roles={"fake": role}, log=lambda m: None)

    bench, out = sweep()
    assert out.measured == 8 and not mismatches(out.entries)
    base = next(e for e in out.entries if e["label"] == "baseline" and e["concurrency"] == 1 and e["category"] == "math")
    assert set(base["outputs"]) == {"82", "82/turn2", "82/turn3", "83"}  # a later turn is checked like any prompt
    same, again = sweep()
    assert same.bench_hash == bench.bench_hash and again.reused == 8 and again.measured == 0
    longer, changed = sweep(reply_tokens=12)
    assert longer.bench_hash != bench.bench_hash and changed.reused == 0 and changed.measured == 8


def test_a_later_turn_found_in_the_training_data_is_named(tmp_path, target_tokenizer):
    rows = read_bench_file(_write(tmp_path / "mt.jsonl", ROWS))
    answers, _ = _replies(rows, target_tokenizer, Scripted(), tmp_path)
    prompts = with_later_turns(rows, answers)
    ids = [p.render(target_tokenizer) for p in prompts]
    asked_alone = tuple(target_tokenizer.render_prompt([{"role": "user", "content": "Double it."}]))
    train = {asked_alone: "chat", tuple(ids[0]): "writing"}
    found = contaminated(prompts, ids, train, target_tokenizer)
    assert [(d["prompt"], d["match"], d["training_dataset"]) for d in found] == [
        ("81", "prompt", "writing"), ("81/turn2", "user turn 1", "writing"),  # its first turn is trained on
        ("82/turn2", "user turn 2", "chat"), ("82/turn3", "user turn 2", "chat")]
    assert [d["prompt"] for d in contaminated(prompts, ids, train)] == ["81"]  # without the tokenizer: whole prompts


@pytest.mark.parametrize("turns, field, words", [
    (["fine", 7], "turns[1]", "must be a non-empty string, got 7"),
    (["fine", "  "], "turns[1]", "must be a non-empty string"),
    ([None, "fine"], "turns[0]", "got None"),
    ("just text", "turns", "non-empty list"),
])
def test_a_bad_later_turn_is_named_by_file_row_and_field(tmp_path, turns, field, words):
    path = _write(tmp_path / "bad.jsonl", [ROWS[0], {"question_id": 9, "category": "math", "turns": turns}])
    with pytest.raises(BenchPromptError) as e:
        read_bench_file(path)
    assert str(e.value).startswith(f"{path}: row 2, field {field!r}: ") and words in str(e.value)


def test_a_file_id_that_a_later_turn_would_take_is_refused(tmp_path, target_tokenizer):
    path = _write(tmp_path / "clash.jsonl", [ROWS[0], {"id": "81/turn2", "category": "chat",
                                                         "messages": [{"role": "user", "content": "hi"}]}])
    rows = read_bench_file(path)
    answers, _ = _replies(rows, target_tokenizer, Scripted(), tmp_path)
    with pytest.raises(BenchPromptError, match=r"clash.jsonl: prompt id '81/turn2' is taken; it names turn 2 of "
                                               r"question '81'"):
        with_later_turns(rows, answers)


def test_the_stage_adds_later_turns_and_reports_the_replies(tmp_path, layout, model_dir):
    from eagle3_assets.serving.stage import PromptChoice, benchmark, serving_dir
    from eagle3_assets.serving.sweep import SweepSpec
    from eagle3_assets.target.spec import TargetSpec

    recipe = SimpleNamespace(name="demo", datasets={})
    (layout.drafter_dir("demo") / "fake").mkdir(parents=True)
    (layout.drafter_dir("demo") / "fake" / "config.json").write_text("{}")
    choice = PromptChoice(bundled=False, files=[str(_write(tmp_path / "mt.jsonl", ROWS))], per_category=1,
                          heldout_per_dataset=0, turn_reply_tokens=5)
    model = Scripted()
    run = lambda: benchmark(layout, recipe, TargetSpec(model_dir), SweepSpec(chains=[1], concurrency=[1]), choice,  # noqa: E731
                            roles={"fake": FakeServe()}, replies=ReplyModel(model.load, "cpu float32"), log=lambda m: None)
    result = run()
    assert [p["prompt"] for p in result["prompts"]] == ["81", "81/turn2", "82", "82/turn2", "82/turn3"]
    assert result["turn_replies"]["made"] == 2 and not result["mismatches"] and result["measured"] == 4
    assert (serving_dir(layout, "demo") / "turn_replies.json").exists()
    again = run()
    assert again["turn_replies"]["reused"] == 2 and again["reused"] == 4 and model.loads == 1
