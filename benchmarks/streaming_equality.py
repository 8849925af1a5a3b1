"""Streamed against offline on a real corpus of two datasets: the same samples in the same order, and
how close the values are, with the offline path's batching and with one row a forward.

The corpus is the target's (SmolLM2, float32, CPU) own greedy replies to the first prompts of two
bundled datasets (``math`` and ``general``), each its own merged corpus, lengths as they come (mixed,
in no order). For each forward batching (``--batch-tokens``, the ``hidden_states`` default 4096, and 1:
one row a forward):

- offline: ``extract_corpus`` of each dataset, then ``run_job`` on both shard directories;
- streamed: one producer process (``python -m eagle3_assets.hidden_states.spool``) beside ``run_job``
  with the same ``batch_tokens``;
- order: each step's sample keys, from the streamed trainer's step records and from the offline loader
  (``ShardBatches`` over the same shards);
- states: every plan unit captured again in this process as a producer does, against the offline
  shards: samples bit-equal, and the largest difference as a share of one bf16 rounding step at its
  token's scale (2^-8 of the token's largest value);
- drafter: the exported tensors (SGLang export, float32), how many are equal and the largest difference.

    .venv/bin/python benchmarks/streaming_equality.py [--per-dataset 20] [--epochs 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
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

from eagle3_assets.drafter.spec_decode import greedy_generate  # noqa: E402
from eagle3_assets.drafter.training.config import ExportSettings  # noqa: E402
from eagle3_assets.drafter.training.data import ShardBatches, ShardDataset  # noqa: E402
from eagle3_assets.drafter.training.job import run_job  # noqa: E402
from eagle3_assets.engines.local.extractor import LocalExtractor  # noqa: E402
from eagle3_assets.hidden_states.extract import extract_corpus  # noqa: E402
from eagle3_assets.hidden_states.reader import ShardReader  # noqa: E402
from eagle3_assets.paths import BUNDLED  # noqa: E402
from eagle3_assets.target.embedded import ensure_default_model  # noqa: E402
from eagle3_assets.target.loading import load_causal_lm  # noqa: E402
from eagle3_assets.target.spec import TargetSpec  # noqa: E402
from tests.support.streaming import LAYER_IDS, producer_job, spawn_producer, stream_settings, train_job, training  # noqa: E402

DATASETS = ("math", "general")


def corpus(path: Path, name: str, target, tok, stop: list[int], n: int, reply_tokens: int) -> Path:
    """The target's greedy replies to the dataset's first ``n`` prompts (every turn but the reply as prompt)."""
    from eagle3_assets.prompts.reader import read_prompt_file

    rows = []
    for p in read_prompt_file(BUNDLED / "demo_prompts" / f"{name}.jsonl").prompts[:n]:  # any of its formats
        text = tok.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=False)
        prompt = list(tok(text, add_special_tokens=False)["input_ids"])
        reply = greedy_generate(target, prompt, max_new_tokens=reply_tokens, stop_ids=stop)
        rows.append({"sample_id": p.prompt_id, "split": "train", "input_ids": prompt + reply,
                     "loss_mask": [0] * len(prompt) + [1] * len(reply)})
    pl.DataFrame(rows, schema_overrides={"input_ids": pl.List(pl.Int32), "loss_mask": pl.List(pl.Int8)}).write_parquet(path)
    return path


def bf16_steps(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    step = torch.maximum(a.abs(), b.abs()).amax(-1, keepdim=True).clamp(min=1e-30) * 2.0 ** -8
    return float(((a - b).abs() / step).max()) if a.numel() else 0.0


def compare_states(tmp: Path, model, corpora: dict, shards: dict, batch_tokens: int) -> dict:
    """Every plan unit captured as a producer captures it (its own rows, ``batch_tokens``), against the shards."""
    from eagle3_assets.drafter.training.stream import open_stream
    from eagle3_assets.hidden_states.spool.produce import Producer
    from eagle3_assets.hidden_states.spool.store import Spool

    spool = tmp / f"states-{batch_tokens}"
    settings = stream_settings(spool, corpora[DATASETS[0]], corpora={str(p): 1.0 for p in corpora.values()},
                               batch_tokens=batch_tokens, cap_bytes=1 << 30)
    _, plan, data = open_stream(settings, training(), rank=0, world=1,
                                target_config={"num_hidden_layers": 30, "hidden_size": 576})
    data.close()
    ex = LocalExtractor(model, layer_ids=LAYER_IDS, device="cpu", dtype="float32")
    producer = Producer(producer_job(spool, model), ex, plan)
    while True:
        with Spool(spool).lock():
            picked = producer.choose()
        if picked is None:
            break
        producer.capture(*picked)
    offline = {}
    for name, d in shards.items():
        offline.update({(str(corpora[name]), s.sample_id): s for s in ShardReader(d).iter_samples()})
    equal = seen = 0
    worst = 0.0
    for unit in plan.units:
        for s in ShardReader(spool / "units" / unit.id).iter_samples():
            o = offline[(plan.corpora[unit.dataset], s.sample_id)]
            seen += 1
            equal += torch.equal(s.aux_hidden, o.aux_hidden) and torch.equal(s.last_hidden, o.last_hidden)
            worst = max(worst, bf16_steps(s.aux_hidden, o.aux_hidden), bf16_steps(s.last_hidden, o.last_hidden))
    shutil.rmtree(spool, ignore_errors=True)
    return {"samples_bit_equal": equal, "samples": seen, "largest_diff_bf16_steps": round(worst, 4)}


def compare_drafters(a: Path, b: Path) -> dict:
    from safetensors.torch import load_file

    x, y = load_file(str(a / "sglang" / "model.safetensors")), load_file(str(b / "sglang" / "model.safetensors"))
    diffs = {k: float((x[k].double() - y[k].double()).abs().max()) for k in x if x[k].is_floating_point()}
    equal = sum(torch.equal(x[k], y[k]) for k in x)
    return {"tensors_equal": equal, "tensors": len(x), "max_abs_diff": max(diffs.values()) if diffs else 0.0}


def one_batching(tmp: Path, model, corpora: dict, batch_tokens: int, settings) -> dict:
    out = tmp / f"bt-{batch_tokens}"
    ex = LocalExtractor(model, layer_ids=LAYER_IDS, device="cpu", dtype="float32")
    shards = {name: out / "shards" / name for name in corpora}
    for name, path in corpora.items():
        extract_corpus(path, shards[name], ex, batch_tokens=batch_tokens, shard_bytes=1 << 40)
    del ex
    export = ExportSettings(engines=("sglang",), dtype="float32")
    datasets = {str(d): 1.0 for d in shards.values()}
    off = run_job(train_job(model, out / "offline", datasets=datasets, settings=settings).model_copy(update={"export": export}))
    loader = ShardBatches(ShardDataset(datasets, max_length=settings.max_length, seed=settings.seed), settings.batch_size,
                          seed=settings.seed)
    keys = [b["keys"] for e in range(math.ceil(off["steps"] / len(loader))) for b in loader.epoch(e)][: off["steps"]]

    spool = out / "spool"
    stream = stream_settings(spool, corpora[DATASETS[0]], corpora={str(p): 1.0 for p in corpora.values()},
                             batch_tokens=batch_tokens, cap_bytes=64 << 20, unit_bytes=1 << 20)
    (out / "producer.json").write_text(producer_job(spool, model).model_dump_json())
    producer = spawn_producer(out / "producer.json", out / "producer.log")
    on = run_job(train_job(model, out / "stream", stream=stream, settings=settings).model_copy(update={"export": export}))
    producer.wait(600)
    assert producer.returncode == 0, (out / "producer.log").read_text()[-2000:]
    from eagle3_assets.drafter.training.checkpoints import latest_checkpoint, load_checkpoint

    records = [m["consumed"]["ids"] for m in load_checkpoint(latest_checkpoint(out / "stream"))["metrics"]]
    same = sum(a == b for step_a, step_b in zip(records, keys) for a, b in zip(step_a, step_b))
    stream_figures = on.get("stream") or {}
    return {"steps": on["steps"], "positions": sum(len(r) for r in records), "positions_same_sample": same,
            "trainer_read_s": stream_figures.get("read_s"), "trainer_verify_s": stream_figures.get("verify_s"),
            **compare_states(out, model, corpora, shards, batch_tokens), **compare_drafters(out / "offline", out / "stream")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-dataset", type=int, default=20)
    ap.add_argument("--reply-tokens", type=int, default=40)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--batch-tokens", type=int, nargs="+", default=[4096, 1])
    ap.add_argument("--record", default="streaming_equality")
    a = ap.parse_args()
    torch.set_num_threads(1)
    model = ensure_default_model(Path(os.environ.get("EAGLE3_MODEL_CACHE") or ROOT / "data" / "models"))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    stop = TargetSpec(model_dir=model).stop_token_ids()
    target = load_causal_lm(model)
    tmp = Path(tempfile.mkdtemp(prefix="eagle3-stream-eq-"))
    try:
        t0 = time.perf_counter()
        corpora = {name: corpus(tmp / f"{name}.parquet", name, target, tok, stop, a.per_dataset, a.reply_tokens)
                   for name in DATASETS}
        del target
        lengths = [len(x) for p in corpora.values() for x in pl.read_parquet(p)["input_ids"]]
        print(f"corpus: {len(lengths)} samples, {sum(lengths)} tokens, lengths {min(lengths)}..{max(lengths)}, "
              f"{len(lengths) - len(set(lengths))} ties ({time.perf_counter() - t0:.0f} s)", flush=True)
        settings = training(epochs=a.epochs, batch_size=a.batch, checkpoint_every=1000, max_length=256, seed=0)
        rows = {}
        for bt in a.batch_tokens:
            rows[f"batch_tokens={bt}"] = one_batching(tmp, model, corpora, bt, settings)
            print(f"batch_tokens={bt}: {json.dumps(rows[f'batch_tokens={bt}'])}", flush=True)
        figures = {"samples": len(lengths), "tokens": sum(lengths), "distinct_lengths": len(set(lengths)),
                   "epochs": a.epochs, "batch_size": a.batch, "wall_s": round(time.perf_counter() - t0, 1),
                   "by_batching": rows}
        record(a.record, figures,
               note="CPU, SmolLM2 float32 target, one torch thread a process; corpus = the target's greedy replies to "
                    "the first prompts of two bundled datasets, one merged corpus each; offline = extract_corpus + "
                    "run_job; streamed = one producer process + run_job; states compared by capturing every plan "
                    "unit in process as a producer does")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
