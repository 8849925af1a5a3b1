import json

import polars as pl

from eagle3_assets.corpus.inventory import read_inventory, response_frame, summarize, write_inventory
from eagle3_assets.corpus.merge import eval_side, merge_corpus
from eagle3_assets.tokens.table import TOKEN_SCHEMA


def token_row(sid, prompt, source="local", native=True, reason="stop", completion=3, text_len=5):
    return {"sample_id": sid, "dataset": "d", "prompt_id": prompt, "sample_index": 0, "source": source,
            "model": "m", "finish_reason": reason, "input_ids": [1] * (2 + completion),
            "loss_mask": [0, 0] + [1] * completion, "prompt_len": 2, "completion_len": completion,
            "text_len": text_len, "native_ids": native, "built_from": "native" if native else "retokenized",
            "retok_matched": 0, "retok_total": 0, "retok_exact": True, "retok_diff": ""}


def test_merge_prefers_native_drops_failed_and_empty():
    rows = [
        token_row("s1", "p1", source="openrouter", native=False),
        token_row("s1", "p1", source="local"),
        token_row("s2", "p2", reason="error"),
        token_row("s3", "p3", completion=1, text_len=0),  # only the end-of-turn token
        token_row("s4", "p4", source="openrouter", native=False),
    ]
    corpus, stats = merge_corpus(pl.DataFrame(rows, schema=TOKEN_SCHEMA), eval_fraction=0.0)
    assert sorted(corpus["sample_id"]) == ["s1", "s4"]
    assert corpus.filter(pl.col("sample_id") == "s1")["source"][0] == "local"
    assert (stats.dropped_failed, stats.dropped_empty, stats.duplicates_resolved) == (1, 1, 1)
    assert stats.prompts_with_both_sources == 1
    assert stats.by_source == {"local": 1, "openrouter": 1}


def test_split_is_by_prompt_and_deterministic():
    rows = [token_row(f"s{i}-{k}", f"p{i}") for i in range(200) for k in range(2)]
    frame = pl.DataFrame(rows, schema=TOKEN_SCHEMA)
    a, sa = merge_corpus(frame, 0.2)
    b, _ = merge_corpus(frame.sample(fraction=1.0, shuffle=True, seed=3), 0.2)
    assert a.select("sample_id", "split").sort("sample_id").equals(b.select("sample_id", "split").sort("sample_id"))
    assert a.group_by("prompt_id").agg(pl.col("split").n_unique())["split"].max() == 1
    assert 40 < sa.eval < 120  # about 20% of 400
    assert eval_side("p1", 0.2) == eval_side("p1", 0.2)


def test_inventory_figures_and_round_trip(tmp_path):
    rows = [{"sample_id": f"s{i}", "source": "local" if i < 6 else "openrouter",
             "finish_reason": "length" if i == 0 else "stop", "completion_tokens": 10 * (i + 1),
             "prompt_tokens": 5, "cost_usd": 0.0 if i < 6 else 0.25} for i in range(8)]
    summary = summarize("d", response_frame(rows), budget_tokens=1000)
    total = summary.filter(pl.col("source") == "all").to_dicts()[0]
    assert total["responses"] == 8 and total["completion_tokens"] == 360
    assert total["budget_used"] == 360 and total["budget_remaining"] == 640
    assert abs(total["cost_usd"] - 0.5) < 1e-12
    assert json.loads(total["finish_reasons"]) == {"length": 1, "stop": 7}
    local = summary.filter(pl.col("source") == "local").to_dicts()[0]
    assert local["responses"] == 6 and local["p50_len"] == 35.0
    db = tmp_path / "m.duckdb"
    write_inventory(db, "d", summary)
    write_inventory(db, "d", summary)  # replacing, not appending
    assert read_inventory(db).height == 3


def test_empty_dataset_inventory():
    summary = summarize("d", response_frame([]), budget_tokens=10)
    assert summary.to_dicts()[0]["responses"] == 0 and summary.to_dicts()[0]["budget_remaining"] == 10
