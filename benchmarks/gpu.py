"""The project's GPU figures in one run, on whatever CUDA device is present (under 7 minutes on an H200).

Each part has a time budget and writes its figures as it finishes (``benchmarks/results.py``,
``gpu.json``), so a run cut short keeps what it measured:

1. memory: one drafter step at Kimi-K2.5's sizes (MLA and Llama-style, bf16 autocast, 3 TTT
   steps) for the recipe's 8 x 8,192 tokens per GPU and 8 x 2,048: peak allocated and reserved
   against the plan's estimate (``benchmarks/training_memory.py``);
2. training speed: ``run_job`` against a bare loop over the same module and batches, both kinds,
   8 x 2,048 (the bare loop's plain step must fit), then ``run_job`` alone at the recipe's length
   under the plan: tokens/s, the ratio, setup seconds and the first step
   (``benchmarks/training_speed.py``);
3. extraction: ``extract_corpus`` end to end against a bare ``output_hidden_states`` forward of a
   random Llama-3.1-8B-shaped target in bf16, shard MB/s against a plain write and fsync
   (``benchmarks/extraction.py``).

It needs torch, transformers, safetensors, numpy, pydantic and polars (the shards' index is
Parquet), not Dagster or DuckDB. ``--tiny`` runs every part at toy sizes on the CPU (a smoke test
of the script, not a figure).

    python benchmarks/gpu.py [--tiny] [--out /scratch] [--parts memory,training,extraction]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from results import record  # noqa: E402

BUDGETS = {"memory": 120, "training": 180, "extraction": 120}  # seconds each part may start new work in


def memory_part(tiny: bool, deadline: float, out: dict) -> None:
    import training_memory as tm

    text = tm.SMOLLM2 if tiny else tm.KIMI
    vocab, draft = (4096, 1024) if tiny else (163840, 32000)
    shapes = [(2, 64), (1, 128)] if tiny else [(8, 2048), (2, 8192), (8, 8192)]
    for att in ("mla", "llama") if not tiny else ("llama",):
        for seqs, length in shapes:
            if time.time() > deadline:
                return
            row = (tm.gpu_row("kimi-k2.5", text, attention=att, sequences=seqs, length=length, vocab=vocab,
                              draft_vocab=draft) if torch.cuda.is_available() else
                   tm.cpu_row("smollm2", text, attention=att, lengths=[length] * seqs, dtype=torch.float32,
                              vocab=vocab, draft_vocab=draft))
            out[f"memory {att} {seqs}x{length}"] = row
            print(row, flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def training_part(tiny: bool, deadline: float, out: dict) -> None:
    import training_speed as ts

    shape = "smollm2" if tiny else "kimi-k2.5"
    rows = [("mla" if not tiny else "llama", 2048 if not tiny else 64, True), ("llama", 2048 if not tiny else 64, True),
            ("mla" if not tiny else "llama", 8192 if not tiny else 128, False)]
    for attention, length, with_bare in rows:
        if time.time() > deadline:
            return
        kw = dict(samples=8 * 6 if not tiny else 12, length=length, batch=8 if not tiny else 2, ttt=3,
                  draft_vocab=32000 if not tiny else 1024, attention=attention, steps=3, warmup=2, rounds=1, threads=0)
        row = ts.compare(shape, **kw) if with_bare else ts.trainer_only(shape, **kw)
        out[f"training {attention} {kw['batch']}x{length}"] = row
        print(row, flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def extraction_part(tiny: bool, deadline: float, out: dict, scratch: Path) -> None:
    import extraction as ex

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = ex.random_model("tiny" if tiny else "llama-8b", device, "bfloat16" if device == "cuda" else "float32")
    row = ex.run_extraction_benchmark(model, sequences=16 if tiny else 256, length=128 if tiny else 2048,
                                      shard_bytes=(8 << 20) if tiny else (1 << 30), batch_tokens=1024 if tiny else 4096,
                                      out_dir=scratch / "extraction", rounds=1 if tiny else 2)
    row.pop("per_round", None)
    out["extraction"] = row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="toy sizes on the CPU: a smoke test of this script")
    ap.add_argument("--out", default=None, help="scratch folder on the disk to measure (default: a temporary one)")
    ap.add_argument("--parts", default="memory,training,extraction")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    if not a.tiny and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --tiny for a CPU smoke test")
    figures: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                     "torch": torch.__version__}
    t0 = time.time()
    with tempfile.TemporaryDirectory(dir=a.out) as tmp:
        for part in a.parts.split(","):
            start = time.time()
            deadline = start + BUDGETS[part]
            try:
                if part == "memory":
                    memory_part(a.tiny, deadline, figures)
                elif part == "training":
                    training_part(a.tiny, deadline, figures)
                else:
                    extraction_part(a.tiny, deadline, figures, Path(tmp))
            except Exception as exc:  # a part that fails leaves the others' figures
                figures[f"{part} error"] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            figures[f"{part} seconds"] = round(time.time() - start, 1)
            print(f"== {part}: {time.time() - start:.0f} s (total {time.time() - t0:.0f} s)", flush=True)
            if not a.no_record:
                record("gpu_tiny" if a.tiny else "gpu", figures)


if __name__ == "__main__":
    main()
