"""How well the trainer's acceptance estimate (EAL) ranks checkpoints against the engines' own counters.

One small drafter is trained on the embedded target (SmolLM2) by the project's trainer: the
target's greedy replies to the bundled demo prompts, every sixth prompt held out as the eval
split the estimate scores (``drafter/training/acceptance.py``). A checkpoint every ``--every``
steps, each with the EAL at chain length ``k`` the trainer logs. Each checkpoint is exported
(float32, through the serving formats' registry) and served by every engine with a serve role on
this machine (the registry's ``ROLES``: vLLM's CPU build, SGLang's CPU engine), a chain of ``k``
draft tokens, greedy, on held-out prompts the drafter never saw (the serving benchmark's bundled
prompts, two per category); the acceptance length is the engine's own counters'
(``EngineAcceptance``). The project's replay evaluator measures the same exports on the same
prompts. Printed and recorded: a row per checkpoint (step, EAL, each engine's AL, the evaluator's
AL), Spearman's rank correlation of EAL against each (``acceptance.spearman``), and whether the
checkpoint the estimate keeps as best is each engine's best.

    .venv/bin/python benchmarks/eal_ranking.py [--steps 120] [--every 15] [--max-new 48] [--engines vllm,sglang]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from results import record  # noqa: E402

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.0f} s] {msg}", flush=True)


def demo_questions() -> list[str]:
    """The first user turn of every bundled demo prompt (general, coding, math), in file order."""
    from eagle3_assets.demo import DEMO_PROMPTS

    out = []
    for path in sorted(DEMO_PROMPTS.glob("*.jsonl")):
        for row in map(json.loads, filter(str.strip, path.read_text().splitlines())):
            turns = [(t["from"], t["value"]) for t in row.get("conversations", [])] + \
                    [(t["role"], t["content"]) for t in row.get("messages", [])]
            out += [text for who, text in turns if who in ("human", "user")][:1]
    return out


def checkpoint_exports(model, model_dir: Path, train_dir: Path, out: Path, k: int) -> dict[int, Path]:
    """Each kept checkpoint's weights exported for both engines: step -> its folder (``sglang/``, ``vllm/``)."""
    from eagle3_assets.drafter import formats
    from eagle3_assets.drafter.training.checkpoints import checkpoints_dir, load_checkpoint

    folders = {}
    for path in sorted(checkpoints_dir(train_dir).glob("step-*.pt")):
        state = load_checkpoint(path)
        model.load_state_dict(state["model"], strict=False)  # as the trainer's use_best loads the best
        folder = out / f"step-{state['step']}"
        formats.export("sglang", model, folder / "sglang", dtype="float32")
        formats.export("vllm", model, folder / "vllm", dtype="float32", verifier=str(model_dir), speculative_tokens=k)
        folders[state["step"]] = folder
    return folders


def serve_all(role, model_dir: Path, folders: dict[int, Path], engine: str, prompts, greedy, stops, args) -> dict:
    """Each checkpoint's export served in turn: step -> the engine's acceptance report (None: failed)."""
    out = {}
    for step, folder in folders.items():
        t0 = time.perf_counter()
        try:
            with role.server(model_dir, folder / engine, k=args.k) as server:
                rep = role.acceptance(role.url(server), prompts, k=args.k, max_new_tokens=args.max_new,
                                      greedy_reference=greedy, stop_token_ids=stops)
        except Exception as e:  # a server that never came up: the row says so, the others still count
            log(f"{engine} step {step}: failed: {str(e)[:300]}")
            out[step] = None
            continue
        out[step] = rep
        log(f"{engine} step {step}: AL {rep.acceptance_length:.3f} ({rep.drafts} verifications, "
            f"equal to greedy: {rep.matches_greedy}, {time.perf_counter() - t0:.0f} s)")
    return out


def ranking(steps: list[int], eal: dict, other: dict) -> dict:
    """Spearman's rho of EAL against ``other`` over the steps both have, and whether EAL's best is theirs."""
    from eagle3_assets.drafter.training.acceptance import spearman

    both = [s for s in steps if other.get(s) is not None]
    if not both:
        return {"points": 0}
    best_eal = max(both, key=lambda s: (eal[s], -s))  # the earliest of equals, as the trainer keeps it
    best_other = max(both, key=lambda s: (other[s], -s))
    rho = spearman([eal[s] for s in both], [other[s] for s in both])
    return {"points": len(both), "spearman": None if rho is None else round(rho, 4), "best_by_eal": best_eal,
            "best_by_it": best_other, "same_best": best_eal == best_other,
            "its_al_at_eal_best": round(other[best_eal], 4), "its_best_al": round(other[best_other], 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--every", type=int, default=15, help="a checkpoint (and its EAL) every this many steps")
    ap.add_argument("--reply-tokens", type=int, default=64, help="the target's greedy reply per training prompt")
    ap.add_argument("--per-category", type=int, default=2, help="held-out serving prompts per category")
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--engines", default="", help="comma-separated serve engines (default: every one on this machine)")
    args = ap.parse_args(argv)

    import torch

    from eagle3_assets.drafter import formats
    from eagle3_assets.drafter.replay_acceptance import replay_acceptance, replay_inputs
    from eagle3_assets.drafter.spec_decode import greedy_generate
    from eagle3_assets.drafter.training.acceptance import best_estimate, estimate_summary
    from eagle3_assets.engines import engine_names, engine_role
    from eagle3_assets.paths import DataLayout
    from eagle3_assets.serving.bench_prompts import bundled_prompts, take_per_category
    from eagle3_assets.target.embedded import EmbeddedModel, ensure_default_model
    from tests.support import small_drafter

    torch.set_num_threads(1)  # the other core is the server's
    model_dir = ensure_default_model(DataLayout.from_env().models_dir)
    embedded = EmbeddedModel(model_dir)
    stops = list(embedded.stop_ids)
    questions = demo_questions()
    train_q = [q for i, q in enumerate(questions) if i % 6]
    eval_q = [q for i, q in enumerate(questions) if i % 6 == 0]
    bench = take_per_category(bundled_prompts(), args.per_category)
    prompts = [p.render(embedded.target_tokenizer) for p in bench]
    corpus = {tuple(embedded.render_prompt([{"role": "user", "content": q}])) for q in questions}
    assert not any(tuple(p) in corpus for p in prompts), "a serving prompt is in the training corpus"
    engines = [e for e in args.engines.split(",") if e] or list(engine_names("serve"))
    roles = {e: engine_role("serve", e) for e in engines}
    missing = {e: r.missing() for e, r in roles.items() if r.missing()}
    roles = {e: r for e, r in roles.items() if e not in missing}
    versions = {e: r.version() for e, r in roles.items()}
    log(f"{len(train_q)} training prompts, {len(eval_q)} eval-split prompts, {len(prompts)} serving prompts; "
        f"engines {versions}; missing {missing}")

    with tempfile.TemporaryDirectory(prefix="eagle3-eal-ranking-") as tmp:
        tmp = Path(tmp)
        features = small_drafter.answer_features(embedded, model_dir, tmp / "train-features", train_q,
                                                 max_new_tokens=args.reply_tokens)
        held = small_drafter.answer_features(embedded, model_dir, tmp / "eval-features", eval_q,
                                             max_new_tokens=args.reply_tokens, split="eval")
        log("features written; training")
        t_train = time.perf_counter()
        model = small_drafter.train_on_features(features, model_dir, tmp / "train", k=args.k, steps=args.steps,
                                                max_length=256, eval_features=held, checkpoint_every=args.every)
        train_s = time.perf_counter() - t_train
        metrics = json.loads((tmp / "train" / "metrics.json").read_text())
        summary = estimate_summary(metrics, args.k)
        estimates = summary["acceptance_estimates"]
        eal = {e["step"]: e["eal"] for e in estimates}
        kept = best_estimate(estimates, args.k)["step"]  # the checkpoint the trainer keeps and exports as best
        log(f"trained {args.steps} steps in {train_s:.0f} s; EAL per checkpoint "
            + " ".join(f"{s}:{v:.3f}" for s, v in eal.items()) + f"; best step {kept}")
        folders = checkpoint_exports(model, model_dir, tmp / "train", tmp / "exports", args.k)
        steps = sorted(folders)
        assert steps == sorted(eal), f"checkpoints {steps} against estimates {sorted(eal)}"

        greedy = [greedy_generate(embedded.model, p, max_new_tokens=args.max_new, stop_ids=stops) for p in prompts]
        items = replay_inputs(embedded.model, prompts, greedy, model.config.aux_layer_ids, lookahead=args.k)
        replay = {}
        for s in steps:
            rep = replay_acceptance(formats.load("vllm", folders[s] / "vllm").float().eval(), items, k=args.k,
                                    max_new_tokens=args.max_new, stop_ids=stops)
            replay[s] = rep.acceptance_length
        log("replay evaluator AL " + " ".join(f"{s}:{v:.3f}" for s, v in replay.items()))
        served = {e: serve_all(r, model_dir, folders, e, prompts, greedy, stops, args) for e, r in roles.items()}

    engine_al = {e: {s: (rep.acceptance_length if rep else None) for s, rep in reps.items()} for e, reps in served.items()}
    rows = {}
    for s in steps:
        row = {"step": s, "eal": round(eal[s], 4), "replay_al": round(replay[s], 4)}
        for e, reps in served.items():
            rep = reps[s]
            row[f"{e}_al"] = round(rep.acceptance_length, 4) if rep else None
            row[f"{e}_equal_greedy"] = rep.matches_greedy if rep else None
        rows[f"step {s}"] = row
    rank = {e: ranking(steps, eal, al) for e, al in engine_al.items()}
    rank["replay"] = ranking(steps, eal, replay)
    wall = time.perf_counter() - T0

    names = [f"{e} AL" for e in served] + ["replay AL"]
    print(f"\n{'step':>6} {'EAL':>7} " + " ".join(f"{n:>11}" for n in names))
    for r in rows.values():
        vals = [r[f"{e}_al"] for e in served] + [r["replay_al"]]
        print(f"{r['step']:>6} {r['eal']:>7.3f} " + " ".join(f"{v:>11.3f}" if v is not None else f"{'-':>11}"
                                                           for v in vals))
    for name, r in rank.items():
        print(f"EAL against {name}: {r}")
    print(f"wall: {wall:.0f} s (training {train_s:.0f} s)")
    record("eal_ranking", {"rows": rows, "ranking": rank,
                           "summary": {"checkpoints": len(steps), "steps": args.steps, "every": args.every,
                                       "training_prompts": len(train_q), "eval_split_prompts": len(eval_q),
                                       "serving_prompts": len(prompts), "max_new_tokens": args.max_new, "k": args.k,
                                       "eal_best_step": kept, "train_s": round(train_s, 1), "wall_s": round(wall, 1)}},
           note=f"SmolLM2-135M-Instruct float32 target; small_drafter shape (draft vocab 512, intermediate 256), "
                f"{args.steps} steps of batch 4 on the target's greedy replies (<= {args.reply_tokens} tokens) to "
                f"{len(train_q)} demo prompts, EAL on the eval split ({len(eval_q)} demo prompts' replies); float32 "
                f"exports of every checkpoint served with a chain of {args.k}, greedy, on {len(prompts)} bundled "
                f"serving prompts ({args.per_category} per category), <= {args.max_new} new tokens; engines "
                f"{versions}; missing {missing}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
