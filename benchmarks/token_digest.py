"""What tamper-evident token rows cost: the digest check over a large token file, and the writer's
extra work, each beside a yardstick in the same run.

A token file of ``--rows`` rows (ids of random lengths around ``--mean-len``, int32, and their int8
masks) is written in Arrow batches with each row's ``row_digest``; then

- ``verify_token_table`` (the ``token_rows_intact`` check's body) reads it back and recomputes every
  digest, against the yardstick of reading the same columns in the same batches without hashing,
  and against DuckDB summing the ids' lengths over the file;
- the table digest (``tokens/digest.py``: every column of the file, rows in order) recomputed over the
  same file, against the same yardstick;
- ``stale_rows`` (the reply check of ``token_rows_intact``) over ``--write-rows`` token rows and
  their reply lines, each about as long as a reply of ``--mean-len`` ids written as JSON;
- ``write_token_table`` on ``--write-rows`` rows as Python dicts (what ``token_ids`` hands it),
  against the same rows written without digests (row digests and the table digest).

Figures go to ``benchmarks/results/token_digest.json``.
Run: `.venv/bin/python benchmarks/token_digest.py [--rows 400000] [--mean-len 384] [--write-rows 20000]`.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def write_big(path: Path, rows: int, mean_len: int, seed: int = 0) -> int:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle3_assets.tokens.digest import row_digest

    rng, done, tokens = np.random.default_rng(seed), 0, 0
    writer = None
    while done < rows:
        n = min(16_384, rows - done)
        lens = rng.integers(mean_len // 2, mean_len * 3 // 2, n)
        flat = rng.integers(0, 150_000, int(lens.sum()), dtype=np.int32)
        mask = (rng.random(int(lens.sum())) < 0.6).astype(np.int8)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        digests = [row_digest(flat[offsets[i]:offsets[i + 1]], mask[offsets[i]:offsets[i + 1]]) for i in range(n)]
        batch = pa.table({
            "dataset": pa.array(["bench"] * n), "sample_id": pa.array([f"s{done + i}" for i in range(n)]),
            "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat)),
            "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask)),
            "row_digest": pa.array(digests)})
        writer = writer or pq.ParquetWriter(str(path), batch.schema)
        writer.write_table(batch)
        done, tokens = done + n, tokens + int(lens.sum())
    writer.close()
    return tokens


def read_only(path: Path) -> int:
    """The yardstick: the same columns, the same batches, the flat buffers made, no hashing."""
    import pyarrow.parquet as pq

    f, n = pq.ParquetFile(str(path)), 0
    for batch in f.iter_batches(batch_size=16_384, columns=["dataset", "sample_id", "input_ids", "loss_mask",
                                                            "row_digest"]):
        batch.column("input_ids").flatten().to_numpy().tobytes()
        batch.column("loss_mask").flatten().to_numpy().tobytes()
        batch.column("row_digest").to_pylist()
        n += batch.num_rows
    return n


def timed(fn, *a):
    t = time.perf_counter()
    out = fn(*a)
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=400_000)
    ap.add_argument("--mean-len", type=int, default=384)
    ap.add_argument("--write-rows", type=int, default=20_000)
    args = ap.parse_args()
    import duckdb
    import numpy as np
    import polars as pl
    import pyarrow.parquet as pq

    from benchmarks.results import record
    from eagle3_assets.files import write_parquet_atomic
    from eagle3_assets.tokens.digest import response_digest, stale_rows, table_digest, verify_token_table
    from eagle3_assets.tokens.table import TOKEN_SCHEMA, write_token_table

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokens.parquet"
        tokens, t_gen = timed(write_big, path, args.rows, args.mean_len)
        size = os.path.getsize(path)
        report, t_verify = timed(verify_token_table, path)
        assert report.rows == args.rows and report.mismatched == 0
        _, t_read = timed(read_only, path)
        with duckdb.connect() as con:
            _, t_duck = timed(lambda: con.execute("SELECT count(*), sum(len(input_ids)) FROM read_parquet(?)",
                                                  [str(path)]).fetchone())
        print(f"token file: {args.rows:,} rows, {tokens:,} ids, {size / 2**20:.0f} MiB")
        print(f"verify (read + recompute every digest): {t_verify:.2f} s, {args.rows / t_verify:,.0f} rows/s, "
              f"{tokens / t_verify / 1e6:.1f} M ids/s")
        print(f"yardstick, same columns read without hashing: {t_read:.2f} s ({t_verify / t_read:.2f}x); "
              f"DuckDB count + lengths: {t_duck:.2f} s")
        f = pq.ParquetFile(str(path))
        _, t_table = timed(lambda: table_digest(f.iter_batches(batch_size=16_384), f.schema_arrow.names))
        print(f"table digest (every column, rows in order): {t_table:.2f} s ({t_table / t_read:.2f}x the yardstick)")

        rng = np.random.default_rng(1)
        rows = []
        for i in range(args.write_rows):
            n = int(rng.integers(args.mean_len // 2, args.mean_len * 3 // 2))
            ids = rng.integers(0, 150_000, n).tolist()
            rows.append({"sample_id": f"s{i}", "dataset": "bench", "input_ids": ids, "loss_mask": [1] * n,
                         "prompt_len": 0, "completion_len": n, "native_ids": True})
        lines = [(json.dumps({"sample_id": r["sample_id"], "output_ids": r["input_ids"], "text": "x" * (4 * len(r["input_ids"]))})
                  .encode()) for r in rows]
        for r, line in zip(rows, lines):
            r["response_digest"] = response_digest(line)
        _, t_with = timed(write_token_table, rows, Path(tmp) / "with.parquet")
        stale, t_stale = timed(stale_rows, Path(tmp) / "with.parquet", iter(lines))
        assert stale.stale == 0 and stale.rows == args.write_rows
        reply_mib = sum(len(x) for x in lines) / 2**20
        print(f"stale replies: {args.write_rows:,} rows against {reply_mib:.0f} MiB of reply lines in {t_stale:.2f} s")
        plain_schema = {k: v for k, v in TOKEN_SCHEMA.items() if k not in ("row_digest", "response_digest")}
        _, t_without = timed(lambda: write_parquet_atomic(pl.DataFrame(rows, schema=plain_schema),
                                                          Path(tmp) / "without.parquet"))
        print(f"writer, {args.write_rows:,} rows as dicts: {t_with:.2f} s with digests, {t_without:.2f} s without "
              f"({t_with / t_without:.2f}x)")
    record("token_digest", {
        "rows": args.rows, "ids": tokens, "file_mib": round(size / 2**20), "verify_s": round(t_verify, 2),
        "verify_rows_per_s": round(args.rows / t_verify), "read_only_s": round(t_read, 2),
        "verify_over_read": round(t_verify / t_read, 2), "duckdb_count_s": round(t_duck, 2),
        "table_digest_s": round(t_table, 2), "table_over_read": round(t_table / t_read, 2),
        "write_rows": args.write_rows, "write_with_digest_s": round(t_with, 2), "write_without_s": round(t_without, 2),
        "write_ratio": round(t_with / t_without, 2), "reply_mib": round(reply_mib), "stale_check_s": round(t_stale, 2)})


if __name__ == "__main__":
    main()
