"""The hidden-state stage: a merged corpus in, verified shards + index + manifest out.

``extract_corpus`` checks the disk first, skips samples already in finished shards (resume),
batches the rest by length (little padding), quarantines samples whose states are not finite
or whose rows cannot be prefilled, and writes the manifest last. It is a pipeline: batch k's
states are packed, checked and copied to the host asynchronously (:mod:`.staging`) and handed
to the shard writer only after batch k+1's forward has been launched, and the writer's threads
write, hash and fsync up to ``shards_in_flight`` shards while the forwards go on. ``verify_shards`` is the
integrity check the asset check runs: every corpus sample stored exactly once or listed as
quarantined, token-exact ids and masks, shapes and dtypes, finite values, checksums.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from eagle3_assets.hidden_states.encoding import sha256_file
from eagle3_assets.hidden_states.shard_check import VerifyReport, check_shard
from eagle3_assets.hidden_states.shards import INDEX, MANIFEST, SHARD_RE, ShardWriter
from eagle3_assets.hidden_states.sizing import check_dtype, estimate_bytes, preflight
from eagle3_assets.hidden_states.staging import StagedBatch, stage

CORPUS_COLUMNS = ("sample_id", "split", "input_ids", "loss_mask")


@dataclass
class ExtractionReport:
    out_dir: str
    planned: int = 0
    already_done: int = 0
    extracted: int = 0
    quarantined_new: int = 0
    quarantined_total: int = 0
    tokens_extracted: int = 0
    tokens_todo: int = 0  # tokens this run set out to extract (known from the start; for progress bars)
    tokens_total: int = 0  # tokens stored in all shards once the run ends (before: stored + todo)
    batches: int = 0
    shards_kept: int = 0
    shards_written: int = 0
    shards_total: int = 0
    shards_dropped: int = 0
    bytes: int = 0
    seconds: float = 0.0
    forward_seconds: float = 0.0  # the main thread inside extractor.extract (on a GPU: launching, not running)
    host_seconds: float = 0.0  # the main thread staging batches and queueing their rows (waits included)
    writer_wait_seconds: float = 0.0  # of which: waiting for a free shard writer (the disk is the bottleneck)
    write_seconds: float = 0.0  # the writer threads' time per shard, added up
    stale_ids: int = 0  # stored samples the corpus no longer has (verify_shards flags them)
    preflight: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_extracted / self.seconds if self.seconds > 0 else 0.0


def load_corpus(corpus_parquet: Path | str) -> pl.DataFrame:
    frame = pl.read_parquet(corpus_parquet, columns=list(CORPUS_COLUMNS))
    dup = frame.height - frame["sample_id"].n_unique()
    if dup:
        twice = frame.group_by("sample_id").len().filter(pl.col("len") > 1).sort("sample_id")
        shown = ", ".join(f"{sid} x{n}" for sid, n in twice.head(5).iter_rows())
        raise ValueError(f"{corpus_parquet}: {dup} duplicate sample rows ({shown}{', ...' if twice.height > 5 else ''}); "
                         "the merged corpus must be unique: re-materialize merged_corpus")
    return frame


def plan_batches(lengths: list[int], batch_tokens: int, max_rows: int | None = None,
                 page_size: int = 1) -> list[list[int]]:
    """Row indices grouped longest first, each group's padded size ``n * max_len`` within budget
    (and at most ``max_rows`` rows, where the backend sizes a request pool). With a paged KV pool
    (SGLang's ``page_size``, 64 for MLA on Blackwell) every row takes whole pages, so the width
    counted is the longest row rounded up to pages."""
    page = max(1, int(page_size))
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        width = -(-(lengths[cur[0]] if cur else lengths[i]) // page) * page
        if cur and ((len(cur) + 1) * width > batch_tokens or (max_rows is not None and len(cur) >= max_rows)):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def _problem(n: int, m: int | None, lo: int | None, hi: int | None, vocab: int | None,
             max_length: int | None = None) -> str | None:
    """Why a corpus row cannot be prefilled, from its length, mask length and id range."""
    if not n:
        return "empty sequence"
    if max_length is not None and n > max_length:
        return f"{n} tokens is longer than the target's context ({max_length})"
    if m != n:
        return f"loss_mask has {m} entries for {n} tokens"
    if vocab is not None and (lo < 0 or hi >= vocab):
        return f"token ids outside the target vocab (0..{vocab - 1})"
    return None


def extract_corpus(
    corpus_parquet: Path | str,
    out_dir: Path | str,
    extractor,
    *,
    dtype: str = "bf16",
    shard_bytes: int = 1 << 30,
    batch_tokens: int = 4096,
    progress: Callable[[ExtractionReport], None] | None = None,
    disk_margin: float | None = 0.1,
    retry_quarantined: bool = False,
    background_writes: bool = True,
    share: tuple[int, int] | None = None,
    skip_ids: set[str] | None = None,
    shards_in_flight: int = 2,
) -> ExtractionReport:
    """Extract every corpus sample not yet stored; safe to re-run after a crash.

    ``batch_tokens`` bounds the padded size of one forward batch; ``shard_bytes`` the size of
    one shard file. With ``background_writes`` up to ``shards_in_flight`` shards are written
    while the next batches run: host memory stays within about ``(1 + shards_in_flight) *
    (shard_bytes + one batch's states) + two batches' states`` (one batch pinned for the copy,
    one waiting for its rows to be queued), whatever the corpus's size.
    ``share`` (rank, world): only this node's share of the corpus (:func:`parts.node_of`);
    ``skip_ids``: samples stored elsewhere already (the main directory of a data-parallel job).
    ``disk_margin``: the free space must hold the estimate plus this share (None: not checked here).
    """
    check_dtype(dtype)
    out_dir = Path(out_dir)
    started = time.perf_counter()
    corpus = load_corpus(corpus_parquet)
    corpus_rows = corpus.height  # the manifest's: the whole corpus, whatever share this run takes
    if share is not None and share[1] > 1:
        from eagle3_assets.hidden_states.parts import node_of

        rank, world = share
        corpus = corpus.filter(pl.col("sample_id").map_elements(lambda s: node_of(s, world) == rank,
                                                                return_dtype=pl.Boolean))
    if skip_ids:
        corpus = corpus.filter(~pl.col("sample_id").is_in(list(skip_ids)))
    desc = extractor.describe()
    hidden = int(extractor.hidden_size)
    report = ExtractionReport(out_dir=str(out_dir), planned=corpus.height)

    writer = ShardWriter(out_dir, hidden_size=hidden, dtype=dtype, shard_bytes=shard_bytes,
                         meta={"target": desc["target"], "layers": desc["layers"]}, background=background_writes,
                         max_inflight=shards_in_flight)
    if retry_quarantined:
        writer.quarantined.clear()  # re-extracted now; a new quarantine record is written if it fails again
    corpus_ids = set(corpus["sample_id"].to_list())
    report.stale_ids = len((writer.done_ids | set(writer.quarantined)) - corpus_ids)
    todo = corpus.filter(~pl.col("sample_id").is_in(list(writer.done_ids | set(writer.quarantined))))
    report.already_done = corpus.height - todo.height
    report.shards_kept = writer.stats.shards_kept
    report.shards_dropped = writer.stats.shards_dropped

    stats = todo.select(
        pl.col("input_ids").list.len().alias("n"), pl.col("loss_mask").list.len().alias("m"),
        pl.col("input_ids").list.min().alias("lo"), pl.col("input_ids").list.max().alias("hi"),
    )
    lengths = stats["n"].to_list()
    report.tokens_todo = sum(n or 0 for n in lengths)
    report.tokens_total = sum(r["tokens"] for r in writer.shards) + report.tokens_todo
    try:
        if disk_margin is not None:  # None: the caller checked the disk for what this run writes
            report.preflight = preflight(out_dir, estimate_bytes(report.tokens_todo, hidden, dtype, todo.height), disk_margin)
    except Exception:
        writer.abort()
        raise

    sid_col = todo["sample_id"].to_list()
    split_col = todo["split"].to_list()
    vocab = getattr(extractor, "vocab_size", None)
    max_length = getattr(extractor, "max_length", None)
    good: list[int] = []
    for i, (n, m, lo, hi) in enumerate(stats.iter_rows()):
        why = _problem(n, m, lo, hi, vocab, max_length)
        if why is None:
            good.append(i)
        else:
            writer.quarantine(sid_col[i], split_col[i], n, why)
            report.quarantined_new += 1

    def store(rows: list[int], ids: list, masks: list, staged: StagedBatch) -> None:
        """Batch ``rows``' staged states into the writer (or quarantine), in corpus-plan order."""
        t0 = time.perf_counter()
        for j, (i, bad) in enumerate(zip(rows, staged.nonfinite())):
            if bad != (0, 0):
                writer.quarantine(sid_col[i], split_col[i], lengths[i],
                                  f"non-finite hidden states: {bad[0]} aux values, {bad[1]} final values")
                report.quarantined_new += 1
                continue
            writer.add_encoded(sid_col[i], split_col[i], ids[j], masks[j], staged.row(j))
            report.extracted += 1
            report.tokens_extracted += lengths[i]
        report.batches += 1
        report.host_seconds += time.perf_counter() - t0
        if progress is not None:
            report.seconds = time.perf_counter() - started
            progress(report)

    waiting = None  # the batch whose copy to the host runs while the next forward does
    try:
        for batch in plan_batches([lengths[i] for i in good], batch_tokens, getattr(extractor, "max_rows", None),
                                  getattr(extractor, "page_size", 1)):
            rows = [good[j] for j in batch]
            part = todo[rows]  # only this batch's ids become Python lists
            ids, masks = part["input_ids"].to_list(), part["loss_mask"].to_list()
            t0 = time.perf_counter()
            feats = extractor.extract(ids)
            t1 = time.perf_counter()
            staged = stage(feats, dtype)
            del feats
            report.forward_seconds += t1 - t0
            report.host_seconds += time.perf_counter() - t1
            previous, waiting = waiting, (rows, ids, masks, staged)
            if previous is not None:
                store(*previous)
        if waiting is not None:
            last, waiting = waiting, None
            store(*last)
        manifest = writer.close({
            "corpus": {"path": str(corpus_parquet), "rows": corpus_rows, "sha256": sha256_file(Path(corpus_parquet))},
            "backend": desc.get("backend"),
            "extraction": {"batch_tokens": batch_tokens, "shard_bytes": shard_bytes},
        })
    except BaseException as exc:
        if waiting is not None and isinstance(exc, Exception):
            try:  # a forward (or the batch before) failed: this batch's states are whole, keep what fills a shard
                store(*waiting)
            except Exception:
                pass
        writer.abort()
        raise
    report.writer_wait_seconds = writer.wait_seconds
    report.shards_written = writer.stats.shards_written
    report.write_seconds = writer.stats.write_seconds
    report.shards_total = len(manifest["shards"])
    report.bytes = manifest["bytes"]
    report.tokens_total = manifest["num_tokens"]
    report.quarantined_total = manifest["num_quarantined"]
    report.seconds = time.perf_counter() - started
    return report


# ---- verification ---------------------------------------------------------------------------

def verify_shards(out_dir: Path | str, corpus_parquet: Path | str, *, chunk_tokens: int = 1 << 15) -> VerifyReport:
    """Integrity of a finished extraction against its corpus; ``report.ok`` and ``report.problems``."""
    out_dir = Path(out_dir)
    report = VerifyReport()
    try:
        corpus = load_corpus(corpus_parquet)
    except (OSError, ValueError) as exc:  # a corpus that cannot be judged against fails the check, it does not crash it
        report.fail(f"the corpus cannot be compared with: {exc}")
        return report
    report.corpus_samples = corpus.height
    if not (out_dir / MANIFEST).exists():
        report.fail(f"{out_dir / MANIFEST} is missing")
        return report
    manifest = json.loads((out_dir / MANIFEST).read_text())
    index = pl.read_parquet(out_dir / manifest.get("index", INDEX))
    report.shards = len(manifest["shards"])
    report.bytes = manifest["bytes"]

    counts = index.group_by("sample_id").len().filter(pl.col("len") > 1)
    for sid, n in counts.iter_rows():
        report.fail(f"sample {sid} appears {n} times in the index")
    have = set(index["sample_id"].to_list())
    want = set(corpus["sample_id"].to_list())
    missing, extra = want - have, have - want
    if missing:
        report.fail(f"{len(missing)} corpus samples neither stored nor quarantined, e.g. {sorted(missing)[:3]}")
    if extra:
        report.fail(f"{len(extra)} stored samples are not in the corpus, e.g. {sorted(extra)[:3]}")

    quarantined = index.filter(pl.col("quarantined"))
    report.quarantined = quarantined.height
    listed = {q["sample_id"] for q in manifest.get("quarantined", [])}
    if set(quarantined["sample_id"].to_list()) != listed or manifest.get("num_quarantined") != len(listed):
        report.fail("quarantined samples in the index and the manifest disagree")
    if quarantined.filter(pl.col("reason").is_null() | (pl.col("reason") == "")).height:
        report.fail("a quarantined sample has no reason")

    stored = index.filter(~pl.col("quarantined"))
    report.stored_samples = stored.height
    lens = stored.join(corpus.select("sample_id", pl.col("input_ids").list.len().alias("clen")), on="sample_id")
    bad = lens.filter(pl.col("length") != pl.col("clen"))
    if bad.height:
        report.fail(f"{bad.height} samples stored with a length different from the corpus, e.g. "
                    f"{bad.sort('sample_id')['sample_id'].to_list()[:3]}")

    listed_files = {e["file"] for e in manifest["shards"]}
    for p in out_dir.glob("shard-*.safetensors"):
        if SHARD_RE.match(p.name) and p.name not in listed_files:
            report.fail(f"{p.name}: shard on disk not listed in the manifest")
    by_shard = {k[0]: g for k, g in stored.group_by("shard")}
    if set(by_shard) - listed_files:
        report.fail(f"index points at shards the manifest does not list: {sorted(set(by_shard) - listed_files)[:3]}")
    for entry in manifest["shards"]:
        rows = by_shard.get(entry["file"])
        if rows is None or rows.height != entry["n_samples"]:
            report.fail(f"{entry['file']}: index holds {0 if rows is None else rows.height} samples, "
                        f"manifest says {entry['n_samples']}")
            continue
        check_shard(out_dir / entry["file"], entry, rows, corpus, manifest, report, chunk_tokens)
    if report.ok and (report.tokens != manifest["num_tokens"] or report.stored_samples != manifest["num_samples"]):
        report.fail(f"manifest counts {manifest['num_samples']} samples / {manifest['num_tokens']} tokens, "
                    f"shards hold {report.stored_samples} / {report.tokens}")
    return report
