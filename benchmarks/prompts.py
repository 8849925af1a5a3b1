"""The `prompts` pass at scale: rows/s and memory per format, against the bare tokenizer.

Writes a synthetic dataset (lengths from a few words to thousands, a few prompts over the
target's context, OpenAI text parts and ShareGPT rows mixed in) as JSONL, JSONL.gz and Parquet,
then runs the whole pass (read, validate, measure with the chat template, check the context,
write the table) on each, every run in a fresh process so its peak memory is its own. Yardstick:
the same conversations, already in memory, measured by the same batched tokenizer call with
nothing else around it; also shown: measuring them one by one, and the pass on a quarter of the
rows (its peak memory should not grow with the file: it holds one chunk). Last, the padded
positions local generation computes for the issue's mix (one 40k-token prompt among short ones),
sorted-only batches vs length batches.

Run: `.venv/bin/python benchmarks/prompts.py [--rows 20000]`.
"""

import argparse
import gzip
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import record

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

WORDS = ("the of and river stone quantum ledger violet harbor anchor meadow cipher lantern orbit granite "
         "willow ember falcon prism tundra velvet comet saffron explain why how list write code test").split()


def synthetic_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = min(int(rng.lognormvariate(4.5, 1.0)), 4000)
        if i % 2000 == 1999:
            words = 30_000  # over an 8k context
        text = " ".join(rng.choice(WORDS) for _ in range(max(words, 3))) + "?"
        if i % 10 == 3:
            rows.append({"id": f"r{i}", "conversations": [{"from": "human", "value": text}]})
        elif i % 10 == 7:
            rows.append({"id": f"r{i}", "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]})
        else:
            rows.append({"id": f"r{i}", "messages": [{"role": "system", "content": "Be helpful."},
                                                     {"role": "user", "content": text}]})
    return rows


def write_files(rows: list[dict], out: Path) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = "".join(json.dumps(r) + "\n" for r in rows)
    paths = {"JSONL": out / "bench.jsonl", "JSONL.gz": out / "bench.jsonl.gz", "Parquet": out / "bench.parquet"}
    paths["JSONL"].write_text(lines)
    with gzip.open(paths["JSONL.gz"], "wt", encoding="utf-8") as fh:
        fh.write(lines)
    # Parquet holds one shape per column: every row as OpenAI messages with string content
    flat = [{"id": r["id"], "messages": [{"role": "user", "content": m.get("value") or _text(m)}
                                         for m in (r.get("messages") or r["conversations"])]} for r in rows]
    pq.write_table(pa.Table.from_pylist(flat), paths["Parquet"], row_group_size=4096)
    return paths


def _text(m: dict) -> str:
    c = m["content"]
    return c if isinstance(c, str) else "\n".join(p["text"] for p in c)


def _reset_peak() -> float:
    """Resets this process's peak RSS (Linux ``clear_refs`` 5) and returns the current RSS in MB."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mb("VmRSS")


def _peak_mb() -> float:
    return _status_mb("VmHWM")


def _status_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one(kind: str, path: str) -> None:
    """One measurement in this (fresh) process; prints a JSON line."""
    from eagle3_assets.paths import DataLayout
    from eagle3_assets.prompts.build import build_prompt_table
    from eagle3_assets.prompts.context import ContextLimit, rendered_lengths
    from eagle3_assets.prompts.reader import PromptReader, read_prompt_file
    from eagle3_assets.target.embedded import ensure_default_model
    from eagle3_assets.target.tokenizer import TargetTokenizer

    tok = TargetTokenizer.load(ensure_default_model(DataLayout.from_env().models_dir))
    tok.render_prompt([{"role": "user", "content": "warm up"}])
    base = _reset_peak()
    t0 = time.perf_counter()
    if kind == "pass":
        with tempfile.TemporaryDirectory() as tmp:
            rep = build_prompt_table(PromptReader(path), tok, ContextLimit(tok.context_length, 256), "skip",
                                     Path(tmp) / "t.parquet")
        extra = {"written": rep.written, "over_context": rep.over_context, "p95": rep.length_figures()["p95"]}
    else:  # yardstick / one_by_one: conversations already in memory, outside the clock
        convs = [p.messages for p in read_prompt_file(path).prompts]
        base, t0 = _reset_peak(), time.perf_counter()
        if kind == "yardstick":
            lengths = [n for i in range(0, len(convs), 1024) for n in rendered_lengths(tok, convs[i:i + 1024])]
        else:
            lengths = [len(tok.render_prompt(c)) for c in convs]
        extra = {"written": len(lengths)}
    print(json.dumps({"seconds": time.perf_counter() - t0, "peak_mb": _peak_mb(), "base_mb": base, **extra}))


def run(kind: str, path: Path, repeat: int) -> dict:
    """The fastest of ``repeat`` fresh-process runs (a shared machine only ever adds time)."""
    results = []
    for _ in range(repeat):
        out = subprocess.run([sys.executable, __file__, "--one", kind, str(path)], capture_output=True, text=True,
                             check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return min(results, key=lambda r: r["seconds"])


def padded_positions() -> dict:
    from eagle3_assets.generation.local import length_batches

    rng = random.Random(1)
    lengths = [rng.randint(20, 400) for _ in range(63)] + [40_000]
    new = 256
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    old = [order[i:i + 16] for i in range(0, len(order), 16)]
    cost = lambda batches: sum(len(b) * (max(lengths[i] for i in b) + new) for b in batches)
    now = length_batches(lengths, 16, max_new_tokens=new)
    print(f"\nlocal generation, 63 prompts of 20-400 tokens + one of 40,000, batch 16, max_new_tokens {new}:")
    print(f"  sorted batches of 16: {len(old)} batches, {cost(old):,} positions computed")
    print(f"  length batches:       {len(now)} batches, {cost(now):,} positions computed "
          f"(ratio {cost(old) / cost(now):.1f}x fewer)")
    return {"sorted_batches_positions": cost(old), "length_batches_positions": cost(now), "ratio": cost(old) / cost(now)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--one", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one(*args.one)
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_files(synthetic_rows(args.rows), Path(tmp))
        sizes = ", ".join(f"{k} {p.stat().st_size / 1e6:.1f} MB" for k, p in paths.items())
        print(f"{args.rows:,} prompts ({sizes}); target SmolLM2-135M-Instruct, context 8,192, reserve 256")
        print(f"{'':34} {'seconds':>8} {'rows/s':>8} {'peak MB over start':>19} {'time vs yardstick':>18}")
        yard = run("yardstick", paths["JSONL"], args.repeat)
        rows = [("yardstick: batched lengths only", yard),
                ("one-by-one lengths", run("one_by_one", paths["JSONL"], args.repeat))]
        rows += [(f"prompts pass, {k}", run("pass", p, args.repeat)) for k, p in paths.items()]
        quarter = Path(tmp) / "quarter.jsonl"
        quarter.write_text("".join(json.dumps(r) + "\n" for r in synthetic_rows(args.rows // 4)))
        rows.append((f"prompts pass, JSONL, {args.rows // 4:,} rows", run("pass", quarter, args.repeat)))
        table = {}
        for name, r in rows:
            n = args.rows // 4 if name.endswith(" rows") else args.rows
            table[name] = {"seconds": r["seconds"], "rows_per_s": n / r["seconds"],
                           "peak_mb_over_start": r["peak_mb"] - r["base_mb"], "time_vs_yardstick": r["seconds"] / yard["seconds"]}
            print(f"{name:34} {r['seconds']:>8.1f} {n / r['seconds']:>8.0f} "
                  f"{r['peak_mb'] - r['base_mb']:>19.0f} {r['seconds'] / yard['seconds']:>17.2f}x")
        last = rows[2][1]
        print(f"pass wrote {last['written']:,} prompts, {last['over_context']} over the context (skipped), "
              f"p95 {last['p95']:,} tokens")
    padding = padded_positions()
    record("prompts", {"rows": args.rows, "passes": table, "written": last["written"],
                       "over_context": last["over_context"], "p95_tokens": last["p95"], "padding": padding})


if __name__ == "__main__":
    main()
