"""An MT-bench row of two turns through the serving sweep in a real vLLM (``.venv-vllm``): turn 2 is
asked after the target's own greedy reply to turn 1 (made once, before the sweep), and every output of
both turns, at a chain of 3 and at concurrency 1 and 2, equals the baseline's, which equals
transformers' greedy decoding. Two server starts are most of its time."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.usefixtures("one_torch_thread")]

MAX_NEW = 16
ROW = {"question_id": 7, "category": "math",
       "turns": ["What is 2+3? Answer with a number only.", "Now double it. Answer with a number only."]}


def test_turn_two_follows_the_targets_reply_and_equals_the_baseline(embedded, model_dir, smol_drafter, tmp_path):
    from eagle3_assets.drafter.spec_decode import greedy_generate
    from eagle3_assets.engines import engine_role
    from eagle3_assets.serving.bench_prompts import prompt_set_hash, read_bench_file
    from eagle3_assets.serving.journal import Journal
    from eagle3_assets.serving.results import mismatches
    from eagle3_assets.serving.sweep import Bench, SweepSpec, run_sweep
    from eagle3_assets.serving.turns import ReplyModel, target_replies, with_later_turns

    export = smol_drafter / "vllm"  # the session's small drafter (tests/support/shared_drafters.py), k=3
    path = tmp_path / "mt.jsonl"
    path.write_text(json.dumps(ROW) + "\n")
    rows = read_bench_file(path)
    replies, _ = target_replies(rows, embedded.target_tokenizer, ReplyModel(lambda: embedded, "cpu float32"),
                                target_id="t", reply_tokens=MAX_NEW, cache=tmp_path / "replies.json")
    prompts = with_later_turns(rows, replies)
    assert [p.prompt_id for p in prompts] == ["7", "7/turn2"] and replies["7"][0].strip()
    ids = [p.render(embedded.target_tokenizer) for p in prompts]
    bench = Bench(prompts, ids, prompt_set_hash(prompts, ids), model_dir, export.parent, "t", "test machine",
                  list(embedded.stop_ids))
    out = run_sweep(bench, SweepSpec(chains=[3], concurrency=[1, 2], max_new_tokens=MAX_NEW, engines=["vllm"]),
                    Journal(tmp_path / "journal.jsonl"), roles={"vllm": engine_role("serve", "vllm")},
                    log=lambda m: print(m, flush=True))
    assert not out.skipped and not out.missing and len(out.entries) == 4, (out.skipped, out.missing)
    assert not mismatches(out.entries), mismatches(out.entries)
    greedy = [greedy_generate(embedded.model, p, max_new_tokens=MAX_NEW, stop_ids=embedded.stop_ids) for p in ids]
    for entry in out.entries:
        assert [entry["outputs"][p.prompt_id] for p in prompts] == greedy, (entry["label"], entry["concurrency"])
