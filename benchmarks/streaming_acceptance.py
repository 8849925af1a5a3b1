"""Acceptance of a streamed drafter against the offline run-to-run spread, on the embedded model (SmolLM2), on CPU.

The corpus is the target's own greedy replies to chat prompts (prompt tokens unmasked, reply
tokens trained), cut to strictly decreasing lengths so the offline shards hold the samples in
corpus order, and extracted one row per forward batch, as the streaming equality test does.
The offline path extracts the shards once and trains the same small drafter from them with
seeds 0, 1 and 2: their acceptance lengths on held-out prompts (the project's evaluator,
``spec_decode.evaluate_acceptance`` on the exported drafter, greedy reference shared) are the
run-to-run spread. Then one streamed run with seed 0: a real producer process captures into the
spool while ``run_job`` trains in the order the spool delivered (the plan). Printed and recorded:
the streamed run's acceptance length, the spread (min / max / std), whether it lies within it,
and whether the streamed drafter's tensors equal offline seed 0's.

    .venv/bin/python benchmarks/streaming_acceptance.py [--samples 40] [--epochs 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import polars as pl  # noqa: E402
import torch  # noqa: E402
from results import record  # noqa: E402

from eagle3_assets.drafter.evaluate import load_export  # noqa: E402
from eagle3_assets.drafter.spec_decode import evaluate_acceptance, greedy_generate  # noqa: E402
from eagle3_assets.drafter.target_weights import read_target_embeddings  # noqa: E402
from eagle3_assets.drafter.training.config import ExportSettings  # noqa: E402
from eagle3_assets.drafter.training.job import run_job  # noqa: E402
from eagle3_assets.engines.local.extractor import LocalExtractor  # noqa: E402
from eagle3_assets.hidden_states.extract import extract_corpus  # noqa: E402
from eagle3_assets.target.embedded import ensure_default_model  # noqa: E402
from eagle3_assets.target.loading import load_causal_lm  # noqa: E402
from eagle3_assets.target.spec import TargetSpec  # noqa: E402
from tests.support.streaming import (  # noqa: E402
    LAYER_IDS,
    producer_job,
    spawn_producer,
    stream_settings,
    train_job,
    training,
)

TOPICS = ["the sea", "a mountain", "bread", "a library", "rain", "a bicycle", "the moon", "coffee", "a garden", "winter",
          "a train", "music", "a river", "chess", "a forest", "the desert", "a city", "snow", "a cat", "a bridge",
          "tea", "an island", "a clock", "fire", "a ship", "a school", "the wind", "a farm", "paper", "a lamp",
          "the sun", "a market", "glass", "a dog", "stars", "a road", "honey", "a castle", "clouds", "a violin",
          "sand", "a kitchen", "a storm", "an apple", "a museum", "ice", "a horse", "a window"]
HELD_OUT = ["a volcano", "a painter", "the harbour", "a pencil", "a festival", "an orchard"]


def render(tok, topic: str) -> list[int]:
    msgs = [{"role": "user", "content": f"Write two sentences about {topic}."}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def corpus(path: Path, target, tok, stop: list[int], n: int, reply_tokens: int) -> Path:
    """The target's greedy replies, longest first, cut so each sample is one token shorter than the one before."""
    rows = []
    for topic in TOPICS[:n]:
        p = render(tok, topic)
        r = greedy_generate(target, p, max_new_tokens=reply_tokens, stop_ids=stop)
        rows.append((p, r))
    rows.sort(key=lambda pr: -(len(pr[0]) + len(pr[1])))
    out, last = [], None
    for i, (p, r) in enumerate(rows):
        ids = (p + r)[: (len(p) + len(r)) if last is None else min(len(p) + len(r), last - 1)]
        last = len(ids)
        mask = [0] * len(p) + [1] * (len(ids) - len(p))
        out.append({"sample_id": f"a{i:03d}", "split": "train", "input_ids": ids, "loss_mask": mask[: len(ids)]})
    assert all(len(a["input_ids"]) > len(b["input_ids"]) for a, b in zip(out, out[1:]))
    assert min(sum(r["loss_mask"]) for r in out) > 0, "a sample lost its whole reply: fewer samples or longer replies"
    pl.DataFrame(out, schema_overrides={"input_ids": pl.List(pl.Int32), "loss_mask": pl.List(pl.Int8)}).write_parquet(path)
    return path


def acceptance(model_dir, out_dir, target, prompts, stop, greedy, k, n) -> float:
    drafter = load_export(out_dir, read_target_embeddings(model_dir)).float().eval()
    rep = evaluate_acceptance(target, drafter, prompts, k=k, max_new_tokens=n, stop_ids=stop, greedy_reference=greedy)
    assert rep.matches_greedy
    return float(rep.acceptance_length)


def same_tensors(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    x, y = load_file(str(a / "sglang" / "model.safetensors")), load_file(str(b / "sglang" / "model.safetensors"))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--reply-tokens", type=int, default=40)
    ap.add_argument("--epochs", type=float, default=3.0)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--eval-tokens", type=int, default=32)
    a = ap.parse_args()
    torch.set_num_threads(1)
    model = ensure_default_model(Path(os.environ.get("EAGLE3_MODEL_CACHE") or ROOT / "data" / "models"))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    stop = TargetSpec(model_dir=model).stop_token_ids()
    target = load_causal_lm(model)
    tmp = Path(tempfile.mkdtemp(prefix="eagle3-stream-acc-"))
    try:
        t0 = time.perf_counter()
        data = corpus(tmp / "corpus.parquet", target, tok, stop, a.samples, a.reply_tokens)
        df = pl.read_parquet(data)
        longest = max(len(x) for x in df["input_ids"])
        tokens = sum(len(x) for x in df["input_ids"])
        held = [render(tok, t) for t in HELD_OUT]
        greedy = [greedy_generate(target, p, max_new_tokens=a.eval_tokens, stop_ids=stop) for p in held]
        print(f"corpus: {len(df)} samples, {tokens} tokens, longest {longest} ({time.perf_counter() - t0:.0f} s)", flush=True)

        ex = LocalExtractor(model, layer_ids=LAYER_IDS, device="cpu", dtype="float32")
        extract_corpus(data, tmp / "shards", ex, batch_tokens=longest)
        del ex
        export = ExportSettings(engines=("sglang",), dtype="float32")

        def settings(seed):
            return training(epochs=a.epochs, batch_size=a.batch, checkpoint_every=1000, max_length=256, seed=seed)

        offline = {}
        for seed in range(a.seeds):
            job = train_job(model, tmp / f"offline-{seed}", datasets={str(tmp / "shards"): 1.0}, settings=settings(seed))
            run_job(job.model_copy(update={"export": export}))
            offline[seed] = acceptance(model, tmp / f"offline-{seed}", target, held, stop, greedy, a.k, a.eval_tokens)
            print(f"offline seed {seed}: acceptance length {offline[seed]:.4f}", flush=True)

        spool = tmp / "spool"
        stream = stream_settings(spool, data, batch_tokens=longest, cap_bytes=16 << 20, unit_bytes=1 << 20)
        (tmp / "producer.json").write_text(producer_job(spool, model).model_dump_json())
        producer = spawn_producer(tmp / "producer.json", tmp / "producer.log")
        job = train_job(model, tmp / "stream", stream=stream, settings=settings(0))
        on = run_job(job.model_copy(update={"export": export}))
        producer.wait(300)
        assert producer.returncode == 0, (tmp / "producer.log").read_text()[-2000:]
        streamed = acceptance(model, tmp / "stream", target, held, stop, greedy, a.k, a.eval_tokens)
        equal = same_tensors(tmp / "stream", tmp / "offline-0")
        values = list(offline.values())
        figures = {
            "samples": len(df), "tokens": tokens, "steps": on["steps"], "epochs": a.epochs, "batch_size": a.batch,
            "held_out_prompts": len(held), "k": a.k, "eval_max_new_tokens": a.eval_tokens,
            "offline_acceptance": {str(s): round(v, 4) for s, v in offline.items()},
            "offline_min": round(min(values), 4), "offline_max": round(max(values), 4),
            "offline_std": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0,
            "streamed_acceptance": round(streamed, 4),
            "streamed_within_spread": min(values) <= streamed <= max(values),
            "streamed_equals_offline_seed0_tensors": equal,
            "streamed_equals_offline_seed0_acceptance": streamed == offline[0],
            "wall_s": round(time.perf_counter() - t0, 1),
        }
        for k, v in figures.items():
            print(f"{k:>40}: {v}")
        record("streaming_acceptance", figures,
               note="CPU, SmolLM2 float32 target, one torch thread a process; corpus = the target's greedy replies to "
                    "chat prompts; offline = one extraction then training with seeds 0..n-1; streamed = one producer "
                    "process + the trainer, seed 0; acceptance on held-out prompts by spec_decode.evaluate_acceptance")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
