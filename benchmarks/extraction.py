"""Extraction end to end against its yardstick, on whatever device is present (CUDA if visible, else CPU).

Per round, over the same length-planned batches of one synthetic corpus:

- bare: ``model(input_ids, attention_mask, output_hidden_states=True)``, the whole model, nothing kept
  (the yardstick);
- forward alone: ``LocalExtractor.extract`` (hooks on the aux layers, no lm_head), states dropped;
- end to end: ``extract_corpus`` (forward, staging, shard writes, hashes, fsyncs, index, manifest);

then a plain write + fsync of the shards' byte count on the same disk, and one thread's sha256 rate.
Rounds alternate the three, so load from other processes hits each alike; medians are reported.
Printed and written through ``benchmarks/results.py`` (``extraction.json``; ``extraction_cuda.json``
on a GPU).

    python benchmarks/extraction.py                     # CPU: the embedded SmolLM2, float32
    python benchmarks/extraction.py --model llama-8b    # GPU: random Llama-3.1-8B-shaped weights, bf16

:func:`run_extraction_benchmark` is the same measurement as a function (``benchmarks/gpu.py`` calls it
with GPU sizes). It needs torch, transformers, safetensors and polars (the corpus and the index are
Parquet), not Dagster.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PRESETS = {  # transformers LlamaConfig fields of random-weight models built on the device
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=4096, max_position_embeddings=4096),
}


def random_model(preset: str, device: str, dtype: str = "bfloat16"):
    """A random-weight ``LlamaForCausalLM`` of the preset's shape, built on ``device`` in ``dtype``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**PRESETS[preset], pad_token_id=0, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def synthetic_corpus(path: Path, sequences: int, length: int, vocab: int, seed: int = 0) -> Path:
    import polars as pl
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (sequences, length), generator=g)
    mask = [0] * (length // 2) + [1] * (length - length // 2)
    pl.DataFrame({"sample_id": [f"b{i:06d}" for i in range(sequences)], "split": ["train"] * sequences,
                  "input_ids": ids.tolist(), "loss_mask": [mask] * sequences},
                 schema_overrides={"input_ids": pl.List(pl.Int32), "loss_mask": pl.List(pl.Int8)}).write_parquet(path)
    return path


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _padded(rows, pad_id: int, device):
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(r)
        mask[i, : len(r)] = 1
    return ids.to(device), mask.to(device)


def bare_pass(model, batches, pad_id: int, device) -> float:
    """Seconds for ``model(..., output_hidden_states=True)`` over every batch (inputs already on the device)."""
    import torch

    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for ids, mask in batches:
            model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    _sync(device)
    return time.perf_counter() - t0


def forward_pass(extractor, rows_batches, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    for rows in rows_batches:
        extractor.extract(rows)
    _sync(device)
    return time.perf_counter() - t0


def plain_write_fsync(directory: Path, nbytes: int, chunk: int = 64 << 20) -> float:
    """Seconds to write ``nbytes`` to a new file in ``directory`` and fsync it (the disk's own rate)."""
    buf = os.urandom(min(chunk, max(1, nbytes)))
    path = directory / "plain-write.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        left = nbytes
        while left > 0:
            left -= fh.write(memoryview(buf)[: min(len(buf), left)])
        fh.flush()
        os.fsync(fh.fileno())
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


def sha256_rate(nbytes: int = 256 << 20) -> float:
    buf = os.urandom(64 << 20)
    t0 = time.perf_counter()
    h = hashlib.sha256()
    for _ in range(max(1, nbytes // len(buf))):
        h.update(buf)
    return max(1, nbytes // len(buf)) * len(buf) / (time.perf_counter() - t0)


def run_extraction_benchmark(model, *, sequences: int, length: int, shard_bytes: int, batch_tokens: int,
                             out_dir: Path | str, rounds: int = 3, shards_in_flight: int = 2, dtype: str = "bf16",
                             log=print) -> dict:
    """The figures of one run (see the module's docstring) for ``model`` where it lies, in its dtype.

    ``out_dir`` is on the disk measured: the corpus, each round's shards (removed after the round)
    and the plain write go there."""
    import polars as pl
    import torch

    from eagle3_assets.engines.local.extractor import LocalExtractor
    from eagle3_assets.hidden_states.extract import extract_corpus, plan_batches, verify_shards

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = next(model.parameters()).device
    extractor = LocalExtractor(model=model, target={"name": "benchmark", "id": None})
    corpus = synthetic_corpus(out_dir / "corpus.parquet", sequences, length, extractor.vocab_size)
    rows = pl.read_parquet(corpus, columns=["input_ids"])["input_ids"].to_list()
    tokens = sum(len(r) for r in rows)
    rows_batches = [[rows[i] for i in b] for b in plan_batches([len(r) for r in rows], batch_tokens)]
    on_device = [_padded(b, extractor.pad_id, device) for b in rows_batches]
    log(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
        f"{type(model).__name__} hidden {extractor.hidden_size} x {extractor.num_layers} layers in "
        f"{next(model.parameters()).dtype}, {torch.get_num_threads()} threads; {sequences} x {length} tokens, "
        f"{len(rows_batches)} batches of <= {batch_tokens}, shards {shard_bytes / 2**20:.0f} MiB, "
        f"{shards_in_flight} in flight; load {os.getloadavg()[0]:.2f}")
    bare_pass(model, on_device[:1], extractor.pad_id, device)  # warm-up: kernels, allocator, pinned pool
    forward_pass(extractor, rows_batches[:1], device)

    per_round = []
    load_start = os.getloadavg()[0]
    for r in range(rounds):
        bare = bare_pass(model, on_device, extractor.pad_id, device)
        fwd = forward_pass(extractor, rows_batches, device)
        shards = out_dir / f"hs-{r}"
        t0 = time.perf_counter()
        rep = extract_corpus(corpus, shards, extractor, dtype=dtype, shard_bytes=shard_bytes, batch_tokens=batch_tokens,
                             shards_in_flight=shards_in_flight)
        _sync(device)
        wall = time.perf_counter() - t0
        if r == 0:
            ok = verify_shards(shards, corpus).ok
        plain = plain_write_fsync(out_dir, rep.bytes)
        shutil.rmtree(shards)
        row = {"bare_tokens_per_s": tokens / bare, "forward_tokens_per_s": tokens / fwd,
               "end_to_end_tokens_per_s": tokens / wall, "ratio": bare / wall, "wall_s": wall,
               "forward_s": rep.forward_seconds, "outside_forward_s": wall - rep.forward_seconds,
               "host_s": rep.host_seconds, "writer_wait_s": rep.writer_wait_seconds,
               "writer_thread_s": rep.write_seconds, "shard_mb_per_s": rep.bytes / wall / 1e6,
               "plain_write_fsync_mb_per_s": rep.bytes / plain / 1e6, "bytes": rep.bytes, "shards": rep.shards_total}
        per_round.append(row)
        log(f"round {r}: bare {row['bare_tokens_per_s']:,.0f} tok/s, forward alone {row['forward_tokens_per_s']:,.0f}, "
            f"extract_corpus {row['end_to_end_tokens_per_s']:,.0f} (ratio {row['ratio']:.3f}); wall {wall:.2f}s, "
            f"main thread in forward {rep.forward_seconds:.2f}s, outside {row['outside_forward_s']:.2f}s "
            f"(staging+queueing {rep.host_seconds:.2f}s, of which waiting for a writer {rep.writer_wait_seconds:.2f}s); "
            f"shards {rep.bytes / 1e6:,.0f} MB at {row['shard_mb_per_s']:,.0f} MB/s of wall, plain write+fsync "
            f"{row['plain_write_fsync_mb_per_s']:,.0f} MB/s")

    def med(key):
        return statistics.median(x[key] for x in per_round)

    figures = {
        "device": str(device), "model_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "hidden_size": extractor.hidden_size, "layers": extractor.num_layers, "threads": torch.get_num_threads(),
        "sequences": sequences, "length": length, "tokens": tokens, "batch_tokens": batch_tokens, "batches": len(rows_batches),
        "shard_bytes": shard_bytes, "shards_in_flight": shards_in_flight, "storage": dtype, "rounds": rounds,
        "bare_tokens_per_s": med("bare_tokens_per_s"), "forward_tokens_per_s": med("forward_tokens_per_s"),
        "end_to_end_tokens_per_s": med("end_to_end_tokens_per_s"), "ratio_end_to_end": med("ratio"),
        "ratio_forward_alone": statistics.median(x["forward_tokens_per_s"] / x["bare_tokens_per_s"] for x in per_round),
        "wall_s": med("wall_s"), "main_forward_s": med("forward_s"), "main_outside_forward_s": med("outside_forward_s"),
        "writer_wait_s": med("writer_wait_s"), "shard_mb_per_s": med("shard_mb_per_s"),
        "plain_write_fsync_mb_per_s": med("plain_write_fsync_mb_per_s"), "shard_bytes_total": per_round[0]["bytes"],
        "shards": per_round[0]["shards"], "sha256_mb_per_s": sha256_rate() / 1e6, "verify_ok": ok,
        "load_start": load_start, "load_end": os.getloadavg()[0], "per_round": per_round,
    }
    log(f"median of {rounds}: bare {figures['bare_tokens_per_s']:,.0f} tok/s, forward alone "
        f"{figures['forward_tokens_per_s']:,.0f} ({figures['ratio_forward_alone']:.3f}x), extract_corpus "
        f"{figures['end_to_end_tokens_per_s']:,.0f} ({figures['ratio_end_to_end']:.3f}x; target >= 0.9 where the disk "
        f"keeps up); shards {figures['shard_mb_per_s']:,.0f} MB/s vs plain write+fsync "
        f"{figures['plain_write_fsync_mb_per_s']:,.0f} MB/s; sha256 {figures['sha256_mb_per_s']:,.0f} MB/s a thread")
    return figures


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (the embedded target) or a preset: " + ", ".join(PRESETS))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="model dtype (auto: bfloat16 on a GPU, float32 on a CPU)")
    ap.add_argument("--seqs", type=int, default=None, help="default: 64 on a CPU, 256 on a GPU")
    ap.add_argument("--len", type=int, default=None, help="default: 256 on a CPU, 2048 on a GPU")
    ap.add_argument("--batch-tokens", type=int, default=None, help="default: 1024 on a CPU, 4096 on a GPU")
    ap.add_argument("--shard-mib", type=int, default=None, help="default: 16 on a CPU, 1024 on a GPU")
    ap.add_argument("--in-flight", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="a folder on the disk to measure (default: a temp folder)")
    ap.add_argument("--name", default=None, help="result file name (default: extraction, extraction_cuda on a GPU)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    from eagle3_assets.target.precision import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    gpu = device.startswith("cuda")
    if args.model == "smollm2":
        from eagle3_assets.target.embedded import ensure_default_model
        from eagle3_assets.target.loading import load_causal_lm

        cache = Path(os.environ.get("EAGLE3_MODEL_CACHE") or ROOT / "data" / "models")
        model = load_causal_lm(ensure_default_model(cache), dtype=dtype, device=device)
    else:
        model = random_model(args.model, device, dtype)
    work = Path(tempfile.mkdtemp(prefix="bench-extraction-", dir=args.out))
    try:
        figures = run_extraction_benchmark(
            model, sequences=args.seqs or (256 if gpu else 64), length=args.len or (2048 if gpu else 256),
            shard_bytes=(args.shard_mib or (1024 if gpu else 16)) << 20,
            batch_tokens=args.batch_tokens or (4096 if gpu else 1024), out_dir=work, rounds=args.rounds,
            shards_in_flight=args.in_flight)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    figures["model"] = args.model
    from results import record

    # the scratch folder is this machine's, not a condition of the figures
    command = [Path(sys.argv[0]).name] + ["<scratch>" if sys.argv[i - 1] == "--out" else a.split("=")[0] + "=<scratch>"
                                          if a.startswith("--out=") else a for i, a in enumerate(sys.argv) if i]
    record(args.name or ("extraction_cuda" if gpu else "extraction"), figures, command=command)


if __name__ == "__main__":
    main()
