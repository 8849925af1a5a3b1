"""A tiny serving sweep in a real engine, checked against independent records: the target's greedy
decoding in transformers and the project's evaluator on the same float32 drafter weights.

Used by the vLLM and SGLang integration tests: two math prompts, the baseline and a chain of 3 at
concurrency 1 and 2, up to 16 new tokens. At concurrency 1 the engine's counters must count exactly
the verification steps and accepted tokens the project's evaluator counts.
"""

from __future__ import annotations

from pathlib import Path

K = 3
MAX_NEW = 16


def tiny_sweep(engine: str, embedded, model_dir: Path, drafter_dir: Path, tmp: Path) -> dict:
    from eagle3_assets.engines import engine_role
    from eagle3_assets.serving.bench_prompts import bundled_prompts, prompt_set_hash
    from eagle3_assets.serving.journal import Journal
    from eagle3_assets.serving.results import mismatches, rows
    from eagle3_assets.serving.sweep import Bench, SweepSpec, run_sweep

    prompts = [p for p in bundled_prompts() if p.category == "math"][:2]
    ids = [p.render(embedded.target_tokenizer) for p in prompts]
    bench = Bench(prompts, ids, prompt_set_hash(prompts, ids), Path(model_dir), Path(drafter_dir), "test-target",
                  "test machine", list(embedded.stop_ids))
    spec = SweepSpec(chains=[K], concurrency=[1, 2], max_new_tokens=MAX_NEW, engines=[engine])
    out = run_sweep(bench, spec, Journal(tmp / "journal.jsonl"), roles={engine: engine_role("serve", engine)},
                    log=lambda m: print(m, flush=True))
    return {"bench": bench, "outcome": out, "rows": rows(out.entries), "mismatches": mismatches(out.entries)}


def independent_records(embedded, model_dir: Path, drafter, bench) -> tuple[list[list[int]], object]:
    """Greedy outputs by transformers, and the project's evaluator's acceptance on the same prompts."""
    from eagle3_assets.drafter.spec_decode import evaluate_acceptance, greedy_generate

    stop = embedded.stop_ids
    greedy = [greedy_generate(embedded.model, p, max_new_tokens=MAX_NEW, stop_ids=stop) for p in bench.ids]
    project = evaluate_acceptance(embedded.model, drafter, bench.ids, k=K, max_new_tokens=MAX_NEW, stop_ids=stop,
                                  greedy_reference=greedy)
    return greedy, project


def assert_sweep_agrees(result: dict, greedy, project) -> None:
    out, bench = result["outcome"], result["bench"]
    assert not out.skipped and not out.missing, (out.skipped, out.missing)
    assert not result["mismatches"], result["mismatches"]
    base = next(e for e in out.entries if e["label"] == "baseline" and e["concurrency"] == 1)
    assert [base["outputs"][p.prompt_id] for p in bench.prompts] == greedy  # the baseline is greedy decoding
    spec1 = next(e for e in out.entries if e["label"] == f"chain {K}" and e["concurrency"] == 1)
    accepted = sum(j * n for j, n in enumerate(project.accepted_histogram))
    acc = spec1["acceptance"]
    assert (acc["drafts"], acc["accepted_tokens"]) == (project.verify_steps, accepted), (acc, project)
    assert acc["accepted_tokens"] > 0  # something was accepted: the counters are not a trivial 1.0
    pooled = {(r["setting"], r["concurrency"]): r for r in result["rows"] if r["category"] == "all"}
    for c in (1, 2):
        r = pooled[(f"chain {K}", c)]
        assert r["speedup"] and r["speedup"] > 0 and r["tokens_per_s"] > 0 and r["ttft_ms"] > 0 and r["tpot_ms"] > 0
        assert r["provenance"]["engine_version"] and r["provenance"]["serve_command"] and r["provenance"]["export_sha256"]
