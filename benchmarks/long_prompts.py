"""EAGLE 3.0 against 3.1 on contexts up to four times the training ``max_length``: acceptance by position.

Two small drafters per seed are trained by the project's trainer on the embedded target
(SmolLM2), identical but for EAGLE 3.1's two switches: ``3.0`` (``fc_norm`` and ``norm_output``
off) and ``3.1`` (both on); same seed, same data, same training ``max_length`` L. The data are
the target's greedy replies (up to ``--reply-tokens``) to the bundled demo prompts, every
fourth prompt held out; a sample longer than L is cut to L, so no training position reaches L.

The held-out prompts become multi-turn conversations (``--turns`` questions each, from
different demo files), rendered by the target's chat template: each turn's user message is a
held-out question, each assistant message the target's greedy reply to the conversation so
far, until the context reaches 4L tokens (the last reply is cut there). Every reply is
measured by the project's replay evaluator (``drafter/replay_acceptance.py``, whose walk equals
the engines' counters step for step) on the float32 vLLM export of each drafter, a chain of
``k`` draft tokens, greedy. Each verification step is placed at the position of the last
verified token (where the chain is drafted) and counted in its bucket [0, L), [L, 2L),
[2L, 3L), [3L, 4L): steps, mean accepted drafts per step, and the acceptance length (AL,
accepted + 1 per step), per variant pooled over seeds and per seed.

    .venv/bin/python benchmarks/long_prompts.py [--max-length 128] [--steps 600] [--seeds 0,1]
"""

from __future__ import annotations

import argparse
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

from eal_ranking import demo_questions  # noqa: E402
from results import record  # noqa: E402

T0 = time.perf_counter()
VARIANTS = {"3.0": {"fc_norm": False, "norm_output": False}, "3.1": {"fc_norm": True, "norm_output": True}}
BUCKETS = 4


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.0f} s] {msg}", flush=True)


def conversation_items(embedded, questions: list[str], turns: int, reply_tokens: int, limit: int):
    """Conversations of ``turns`` held-out questions (question i, i + n, ... for n conversations),
    each reply the target's greedy one, the context never past ``limit`` tokens:
    ``[(prompt ids, reply ids, max_new_tokens the reply was generated with)]``."""
    from eagle3_assets.drafter.spec_decode import greedy_generate

    stops = list(embedded.stop_ids)
    n = len(questions) // turns
    out = []
    for c in range(n):
        messages = []
        for q in questions[c::n][:turns]:
            messages.append({"role": "user", "content": q})
            prompt = embedded.render_prompt(messages)
            room = min(reply_tokens, limit - len(prompt))
            if room < 4:
                break
            reply = greedy_generate(embedded.model, prompt, max_new_tokens=room, stop_ids=stops)
            out.append((prompt, reply, room))
            text = embedded.tokenizer.decode([t for t in reply if t not in stops], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": text})
    return out


def positioned_steps(drafter, items, max_new: list[int], *, k: int, stops: list[int]):
    """The evaluator's verification steps on every item as ``(position, accepted)``, where the
    position is that of the last verified token (the chain is drafted after it), and whether each
    walk emitted the target's greedy reply."""
    from eagle3_assets.drafter.replay_acceptance import replay_one

    steps, equal = [], True
    for item, m in zip(items, max_new):
        res = replay_one(drafter, item, k=k, max_new_tokens=m, stop_ids=stops)
        equal &= res.output_ids == item.ids[item.prompt_len: item.prompt_len + item.reply_len].tolist()
        pos = item.prompt_len
        for a in res.accepted:
            steps.append((pos, a))
            pos += 1 + a
    return steps, equal


def by_bucket(steps, length: int) -> list[dict]:
    rows = []
    for b in range(BUCKETS):
        acc = [a for p, a in steps if min(p // length, BUCKETS - 1) == b]
        n = len(acc)
        rows.append({"steps": n, "accepted": sum(acc), "mean_accepted": sum(acc) / n if n else 0.0,
                     "al": (sum(acc) + n) / n if n else 0.0})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-length", type=int, default=128, help="the training max_length L")
    ap.add_argument("--steps", type=int, default=600, help="training steps (batch 4) per drafter")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--reply-tokens", type=int, default=96, help="the target's greedy reply per prompt")
    ap.add_argument("--turns", type=int, default=4, help="held-out questions per conversation")
    ap.add_argument("--holdout-every", type=int, default=4, help="every n-th demo prompt is held out")
    ap.add_argument("-k", type=int, default=3)
    args = ap.parse_args(argv)

    import torch

    from eagle3_assets.drafter import formats
    from eagle3_assets.drafter.replay_acceptance import replay_inputs
    from eagle3_assets.drafter.training.data import ShardDataset
    from eagle3_assets.paths import DataLayout
    from eagle3_assets.target.embedded import EmbeddedModel, ensure_default_model
    from tests.support import small_drafter

    torch.set_num_threads(1)
    L, k, seeds = args.max_length, args.k, [int(s) for s in args.seeds.split(",") if s]
    model_dir = ensure_default_model(DataLayout.from_env().models_dir)
    embedded = EmbeddedModel(model_dir)
    stops = list(embedded.stop_ids)
    questions = demo_questions()
    train_q = [q for i, q in enumerate(questions) if i % args.holdout_every]
    held_q = [q for i, q in enumerate(questions) if i % args.holdout_every == 0]

    with tempfile.TemporaryDirectory(prefix="eagle3-long-prompts-") as tmp:
        tmp = Path(tmp)
        features = small_drafter.answer_features(embedded, model_dir, tmp / "features", train_q,
                                                 max_new_tokens=args.reply_tokens)
        data = ShardDataset({features: 1.0}, max_length=L)
        lengths = [data.readers[0].location(sid)[2] for _, sid in data.entries]
        aux_ids = data.aux_layer_ids
        data.close()
        cut = sum(n > L for n in lengths)
        log(f"{len(train_q)} training samples, {sum(lengths)} tokens, longest {max(lengths)}, "
            f"{cut} longer than L={L} (cut to it), {sum(min(n, L) for n in lengths)} tokens trained on")

        convs = conversation_items(embedded, held_q, args.turns, args.reply_tokens, BUCKETS * L)
        prompts, replies, max_new = [c[0] for c in convs], [c[1] for c in convs], [c[2] for c in convs]
        items = replay_inputs(embedded.model, prompts, replies, aux_ids, lookahead=k)
        mismatches = sum(it.greedy_mismatches for it in items)
        log(f"{len(items)} replies in {len(held_q) // args.turns} conversations, contexts up to "
            f"{max(len(p) + len(r) for p, r in zip(prompts, replies))} tokens, {sum(map(len, replies))} reply "
            f"tokens; prefill argmax mismatches {mismatches}")

        results, train_s = {}, {}
        for seed in seeds:
            for name, switches in VARIANTS.items():
                t = time.perf_counter()
                model = small_drafter.train_on_features(features, model_dir, tmp / f"train-{name}-{seed}", k=k,
                                                        steps=args.steps, max_length=L, seed=seed, **switches)
                train_s[(name, seed)] = time.perf_counter() - t
                export = small_drafter.export_vllm_float(model, model_dir, tmp / f"vllm-{name}-{seed}", k=k)
                drafter = formats.load("vllm", export).float().eval()
                assert bool(drafter.config.fc_norm) == switches["fc_norm"]
                assert bool(drafter.config.norm_output) == switches["norm_output"]
                steps, equal = positioned_steps(drafter, items, max_new, k=k, stops=stops)
                results[(name, seed)] = steps
                total = sum(a for _, a in steps)
                log(f"{name} seed {seed}: trained in {train_s[(name, seed)]:.0f} s; AL {(total + len(steps)) / len(steps):.3f} "
                    f"over {len(steps)} steps; output equal to greedy: {equal}")
                assert equal, "the replay walk did not emit the target's greedy reply"

    buckets = {}
    for b in range(BUCKETS):
        label = f"{b * L}-{(b + 1) * L - 1}"
        row = {}
        for name in VARIANTS:
            pooled = [s for seed in seeds for s in results[(name, seed)]]
            cell = by_bucket(pooled, L)[b]
            tag = name.replace(".", "")
            row[f"steps_{tag}"], row[f"al_{tag}"] = cell["steps"], round(cell["al"], 4)
            row[f"accepted_{tag}"] = round(cell["mean_accepted"], 4)
            for seed in seeds:
                row[f"al_{tag}_seed{seed}"] = round(by_bucket(results[(name, seed)], L)[b]["al"], 4)
        row["al_31_minus_30"] = round(row["al_31"] - row["al_30"], 4)
        buckets[label] = row
    overall = {}
    for name in VARIANTS:
        tag = name.replace(".", "")
        for seed in seeds:
            st = results[(name, seed)]
            overall[f"al_{tag}_seed{seed}"] = round((sum(a for _, a in st) + len(st)) / len(st), 4)
    wall = time.perf_counter() - T0

    cols = ["steps_30", "al_30", "steps_31", "al_31", "al_31_minus_30"] + \
        [f"al_{t}_seed{s}" for t in ("30", "31") for s in seeds]
    print(f"\n{'bucket':>10} " + " ".join(f"{c:>14}" for c in cols))
    for label, row in buckets.items():
        print(f"{label:>10} " + " ".join(f"{row[c]:>14}" for c in cols))
    print(f"overall AL: {overall}")
    print(f"wall: {wall:.0f} s; training " + ", ".join(f"{n} seed {s}: {v:.0f} s" for (n, s), v in train_s.items()))
    summary = {"max_length": L, "context_limit": BUCKETS * L, "training_steps": args.steps, "batch_size": 4,
               "seeds": len(seeds), "k": k, "training_prompts": len(train_q), "training_tokens": sum(lengths),
               "training_samples_cut": cut, "heldout_prompts": len(held_q),
               "conversations": len(held_q) // args.turns, "replies": len(items),
               "reply_tokens": sum(map(len, replies)), "longest_context": max(len(p) + len(r) for p, r in
                                                                             zip(prompts, replies)),
               "train_s_mean": round(sum(train_s.values()) / len(train_s), 1), "wall_s": round(wall, 1), **overall}
    record("long_prompts", {"buckets": buckets, "summary": summary},
           note=f"SmolLM2-135M-Instruct float32 target; small_drafter shape (Llama-style, draft vocab 512, "
                f"intermediate 256), {args.steps} steps of batch 4 at max_length {L}, lr 3e-3, on the target's greedy "
                f"replies (<= {args.reply_tokens} tokens) to {len(train_q)} demo prompts; 3.0 = fc_norm and "
                f"norm_output off, 3.1 = both on, otherwise identical, seeds {seeds}; evaluated by the replay "
                f"evaluator on float32 vLLM exports, chain of {k}, greedy, on {len(items)} greedy replies in "
                f"{len(held_q) // args.turns} multi-turn conversations of held-out demo prompts, contexts "
                f"<= {BUCKETS * L} tokens; a step's bucket is its last verified token's position; AL pooled over "
                f"seeds; one torch thread on a 2-core CPU shared with other work")
    return 0


if __name__ == "__main__":
    sys.exit(main())
