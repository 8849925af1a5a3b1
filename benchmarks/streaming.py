"""Streaming against extract-then-train on the embedded model (SmolLM2) or kimi-mini, on CPU, in one run.

The same corpus, the same training settings: first the offline path (``extract_corpus`` writes
every shard, then ``run_job`` trains on them), then the streaming path (one producer process
captures into the spool while ``run_job`` trains from it). Printed: the offline path's disk
(its shard directory, read from the filesystem), the spool's peak bytes (sampled from the
filesystem every 10 ms) against the cap, the trainer's and the producer's waiting shares (their
own wait clocks over their wall time), and the wall time of each path with the ratio. One torch
thread per process on both paths: the offline path runs its two stages one after the other, the
streaming path runs them side by side (two processes on two cores).

``--target kimi-mini`` runs the same on the project's miniature Kimi-K2.5-shaped target (MLA
attention, MoE, 7 layers, hidden 64, 163,840-id vocabulary, aux layers [1, 2, 3]) with an MLA
drafter, as the kimi-mini recipe trains it, and writes ``streaming_kimi_mini.json``.

    .venv/bin/python benchmarks/streaming.py [--target kimi-mini] [--samples 48] [--cap-steps 3]
"""

from __future__ import annotations

import argparse
import json
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

from eagle3_assets.drafter.training.config import DraftShape  # noqa: E402
from eagle3_assets.drafter.training.job import run_job  # noqa: E402
from eagle3_assets.engines.local.extractor import LocalExtractor  # noqa: E402
from eagle3_assets.hidden_states.extract import extract_corpus  # noqa: E402
from eagle3_assets.hidden_states.spool.plan import build_plan, write_plan  # noqa: E402
from eagle3_assets.hidden_states.spool.preflight import stream_preflight  # noqa: E402
from eagle3_assets.target.embedded import ensure_default_model  # noqa: E402
from eagle3_assets.target.kimi_mini import ensure_kimi_mini  # noqa: E402
from tests.support.streaming import (  # noqa: E402
    DRAFT_VOCAB,
    LAYER_IDS,
    Sampler,
    filesystem_bytes,
    producer_job,
    spawn_producer,
    stream_settings,
    train_job,
    training,
)

# What differs per target: its directory, the captured layers, its hidden size, the ids a corpus may
# draw (below the special tokens), the drafter's shape (None: tests/support's small Llama drafter),
# the result file's name and the note's words for it.
TARGETS = {
    "smollm2": dict(ensure=ensure_default_model, layer_ids=LAYER_IDS, hidden_size=576, id_high=49152, shape=None,
                    unit_bytes=1 << 20,
                    result="streaming", label="SmolLM2 float32"),
    # units of 1 MiB x 64/576: about as many tokens a unit as SmolLM2's 1 MiB units hold
    "kimi-mini": dict(ensure=ensure_kimi_mini, layer_ids=[1, 2, 3], hidden_size=64, id_high=163584, unit_bytes=116_508,
                      shape=DraftShape(draft_vocab_size=DRAFT_VOCAB, intermediate_size=128, aux_layer_ids=[1, 2, 3],
                                       attention="mla"),
                      result="streaming_kimi_mini",
                      label="kimi-mini float32 (Kimi-K2.5 shape: MLA + MoE, 7 layers, hidden 64, vocab 163,840; "
                            "aux layers [1, 2, 3]), MLA drafter (draft vocab 512, intermediate 128)"),
}


def corpus(path: Path, n: int, seed: int = 0, id_high: int = 49152) -> Path:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        t = int(torch.randint(64, 160, (1,), generator=g))
        ids = torch.randint(3, id_high, (t,), generator=g).tolist()
        rows.append({"sample_id": f"b{i:04d}", "split": "train", "input_ids": ids,
                     "loss_mask": [0] * (t // 3) + [1] * (t - t // 3)})
    pl.DataFrame(rows, schema_overrides={"input_ids": pl.List(pl.Int32), "loss_mask": pl.List(pl.Int8)}).write_parquet(path)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=sorted(TARGETS), default="smollm2")
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--cap-steps", type=float, default=1.5, help="the cap, in multiples of the least the preflight accepts")
    ap.add_argument("--unit-bytes", type=int, default=None, help="default: 1 MiB for SmolLM2, 116,508 for kimi-mini")
    a = ap.parse_args()
    tgt = TARGETS[a.target]
    a.unit_bytes = a.unit_bytes or tgt["unit_bytes"]
    model = tgt["ensure"](Path(os.environ.get("EAGLE3_MODEL_CACHE") or ROOT / "data" / "models"))
    tmp = Path(tempfile.mkdtemp(prefix="eagle3-stream-bench-"))
    try:
        data = corpus(tmp / "corpus.parquet", a.samples, id_high=tgt["id_high"])
        settings = training(epochs=1.0, batch_size=a.batch, checkpoint_every=5, max_length=256)
        torch.set_num_threads(1)

        t0 = time.perf_counter()
        ex = LocalExtractor(model, layer_ids=tgt["layer_ids"], device="cpu", dtype="float32")
        rep = extract_corpus(data, tmp / "shards", ex, batch_tokens=1024)
        t_extract = time.perf_counter() - t0
        off = run_job(train_job(model, tmp / "offline", datasets={str(tmp / "shards"): 1.0}, settings=settings,
                                shape=tgt["shape"]))
        t_offline = time.perf_counter() - t0
        offline_bytes = filesystem_bytes(tmp / "shards")
        del ex

        spool = tmp / "spool"
        probe = stream_settings(spool, data, batch_tokens=1024, unit_bytes=a.unit_bytes, layer_ids=tgt["layer_ids"])
        plan = write_plan(spool, build_plan(probe, seed=0, batch_size=a.batch, world=1, total_steps=off["steps"],
                                            hidden_size=tgt["hidden_size"], max_length=settings.max_length))
        floor = stream_preflight(plan, spool_dir=spool)["min_cap_bytes"]
        shutil.rmtree(spool)
        cap = int(floor * a.cap_steps)
        stream = stream_settings(spool, data, batch_tokens=1024, unit_bytes=a.unit_bytes, cap_bytes=cap,
                                 layer_ids=tgt["layer_ids"])
        (tmp / "producer.json").write_text(producer_job(spool, model).model_dump_json())
        sampler = Sampler(spool)
        t1 = time.perf_counter()
        producer = spawn_producer(tmp / "producer.json", tmp / "producer.log")
        on = run_job(train_job(model, tmp / "stream", stream=stream, settings=settings, shape=tgt["shape"]))
        t_stream = time.perf_counter() - t1
        producer.wait(120)
        peak = sampler.stop()
        log = (tmp / "producer.log").read_text()
        pstats = json.loads(log[log.rindex("producer done: ") + len("producer done: "):].splitlines()[0])
        train_wall = on["wall_s"] if "wall_s" in on else t_stream
        figures = {
            "samples": a.samples, "tokens": rep.tokens_total, "steps": on["steps"],
            "offline_disk_bytes": offline_bytes, "cap_bytes": cap, "min_cap_bytes": floor,
            "peak_spool_bytes": peak, "peak_over_cap": round(peak / cap, 3), "peak_over_offline": round(peak / offline_bytes, 3),
            "trainer_wait_share": round(on["stream"]["wait_s"] / train_wall, 3),
            "producer_wait_share": round(pstats["wait_s"] / pstats["seconds"], 3),
            "offline_extract_s": round(t_extract, 1), "offline_total_s": round(t_offline, 1),
            "stream_total_s": round(t_stream, 1), "stream_over_offline": round(t_stream / t_offline, 3),
            "units": on["stream"]["units"], "captured_units": pstats["units"], "unit_bytes": a.unit_bytes,
        }
        for k, v in figures.items():
            print(f"{k:>22}: {v:,}" if isinstance(v, int) else f"{k:>22}: {v}")
        record(tgt["result"], figures, note=f"CPU, {tgt['label']}, one torch thread a process; offline = extract then "
                                            "train in one process, streaming = one producer process + the trainer")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
