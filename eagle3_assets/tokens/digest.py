"""Digests written with the token table (and the corpus), so an edit made after them is seen.

Per row, ``row_digest``: an id or a mask changed after ``token_ids`` is named by its row. Per
file, the table digest: a row deleted, duplicated or moved, or any column edited (``prompt_len``,
where evaluation cuts each held-out prompt; ``split``; an agreement figure a check reads) changes
it, though every row's own digest still holds. And per row, ``response_digest``: the reply line
of ``responses/<dataset>/<source>.jsonl`` the row was built from, so a reply edited there
afterwards shows the row as stale.

The token checks read figures stored when the file was built (agreement, literal specials); an id
edited afterwards (by hand, a faulty copy, a tool that rewrites Parquet) changes none of them and
passes. So the writer stores ``row_digest``, a BLAKE2b-128 of the row's ``input_ids`` (int32
little-endian) and ``loss_mask`` (int8) bytes, each prefixed by its length, and
``token_rows_intact`` recomputes it over the file in Arrow batches (constant memory; the flat id
buffer of a batch is hashed row by row without building Python lists; ``benchmarks/token_digest.py``
measures it).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

DIGEST_COLUMN = "row_digest"
RESPONSE_DIGEST_COLUMN = "response_digest"
TABLE_KEY = "eagle3.table_digest"  # Parquet key-value metadata
BATCH_ROWS = 16_384
SHOWN = 5  # sample ids a description names


def row_digest(input_ids, loss_mask) -> str:
    """The digest of one row (what the writer stores and the check recomputes)."""
    ids = np.asarray(input_ids, dtype="<i4").tobytes()
    mask = np.asarray(loss_mask, dtype="i1").tobytes()
    return _digest(ids, mask)


def _digest(ids: bytes, mask: bytes) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(struct.pack("<QQ", len(ids) // 4, len(mask)))
    h.update(ids)
    h.update(mask)
    return h.hexdigest()


@dataclass
class DigestReport:
    rows: int = 0
    has_digest: bool = True
    mismatched: int = 0
    first: list[dict] = field(default_factory=list)  # dataset, sample_id of the first mismatches

    def names(self, n: int = SHOWN) -> str:
        """The first mismatching rows as ``dataset/sample_id``, and how many more."""
        shown = ", ".join(f"{r['dataset']}/{r['sample_id']}" for r in self.first[:n])
        more = self.mismatched - min(n, len(self.first))
        return shown + (f" and {more:,} more" if more > 0 else "")


def verify_token_table(path: Path | str, keep: int = 10, batch_rows: int = BATCH_ROWS) -> DigestReport:
    """Recompute every row's digest of the token file at ``path`` and compare it with the stored one."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    f = pq.ParquetFile(str(path))
    report = DigestReport()
    if DIGEST_COLUMN not in f.schema_arrow.names:
        report.has_digest = False
        report.rows = f.metadata.num_rows
        return report
    cols = ["dataset", "sample_id", "input_ids", "loss_mask", DIGEST_COLUMN]
    for batch in f.iter_batches(batch_size=batch_rows, columns=cols):
        ids_col, mask_col = batch.column("input_ids"), batch.column("loss_mask")
        ids_off = ids_col.offsets.to_numpy()
        mask_off = mask_col.offsets.to_numpy()
        ids_flat = pc.cast(ids_col.flatten(), pa.int32()).to_numpy(zero_copy_only=False).astype("<i4", copy=False)
        mask_flat = pc.cast(mask_col.flatten(), pa.int8()).to_numpy(zero_copy_only=False)
        ids_bytes, mask_bytes = memoryview(ids_flat.tobytes()), memoryview(mask_flat.tobytes())
        base_i, base_m = ids_off[0], mask_off[0]
        stored = batch.column(DIGEST_COLUMN).to_pylist()
        for i, want in enumerate(stored):
            a, b = (ids_off[i] - base_i) * 4, (ids_off[i + 1] - base_i) * 4
            c, d = mask_off[i] - base_m, mask_off[i + 1] - base_m
            if _digest(ids_bytes[a:b], mask_bytes[c:d]) != want:
                report.mismatched += 1
                if len(report.first) < keep:
                    report.first.append({"dataset": batch.column("dataset")[i].as_py(),
                                         "sample_id": batch.column("sample_id")[i].as_py(),
                                         "stored_digest": want})
        report.rows += batch.num_rows
    return report


def response_digest(line: bytes) -> str:
    """The digest of one reply line as the response file holds it (no newline)."""
    return hashlib.blake2b(line, digest_size=16).hexdigest()


# ----------------------------------------------------------------------------- the table digest


def _h():
    return hashlib.sha256()  # SHA extensions make it the fastest of hashlib's on current x86 and ARM cores


class _Stream:
    """One column's digest at one nesting level: null positions, lengths, values, each a stream of
    its own, so the digest does not depend on where the batches split."""

    def __init__(self):
        self.nulls, self.lengths, self.values, self.seen = _h(), _h(), _h(), 0
        self.child: _Stream | None = None

    def digest(self) -> bytes:
        parts = [self.nulls.digest(), self.lengths.digest(), self.values.digest()]
        return b"".join(parts) + (self.child.digest() if self.child is not None else b"")


def _native(arr):
    """A primitive array's values as a contiguous numpy array, nulls as zero (no copy when none)."""
    import pyarrow.compute as pc

    return (pc.fill_null(arr, False if arr.type.id == 1 else 0) if arr.null_count else arr).to_numpy(zero_copy_only=False)


def _feed(arr, st: _Stream) -> None:
    """Column ``arr`` (one batch) into its streams. Values keep their Arrow type's width; the type
    itself is part of the digest (``table_digest``)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if arr.null_count:
        nulls = np.flatnonzero(~pc.is_valid(arr).to_numpy(zero_copy_only=False)) + st.seen
        st.nulls.update(nulls.astype("<i8").tobytes())
    st.seen += len(arr)
    t = arr.type
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t) or pa.types.is_large_list_view(t):
        st.lengths.update(np.ascontiguousarray(_native(pc.list_value_length(arr))))
        st.child = st.child or _Stream()
        return _feed(arr.flatten(), st.child)
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t) \
            or pa.types.is_string_view(t) or pa.types.is_binary_view(t):
        arr = arr.cast(pa.large_binary())
        offsets = np.frombuffer(arr.buffers()[1], dtype="<i8")[arr.offset: arr.offset + len(arr) + 1]
        st.lengths.update(np.diff(offsets))
        if len(arr):
            st.values.update(memoryview(arr.buffers()[2])[int(offsets[0]):int(offsets[-1])])
        return None
    if pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_floating(t):
        st.values.update(np.ascontiguousarray(_native(arr)))
    else:  # no such column in the project's tables; still covered, if slowly
        st.values.update(json.dumps(arr.to_pylist(), default=str).encode())
    return None


def _kind(t) -> str:
    """An Arrow type as the digest names it: the same for the list, string and binary layouts that
    hold the same values (a writer may pick the large or view one), the width of numbers kept."""
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        return _kind(t.value_type)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t) or pa.types.is_large_list_view(t):
        return f"list<{_kind(t.value_type)}>"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return "binary"
    return str(t)


def table_digest(batches, columns: list[str]) -> dict:
    """The digest of ``columns`` over Arrow record ``batches`` in order: rows, per column, and all."""
    streams = {c: _Stream() for c in columns}
    types: dict[str, str] = {}
    rows = 0
    for batch in batches:
        rows += batch.num_rows
        for c in columns:
            col = batch.column(c)
            types.setdefault(c, _kind(col.type))
            _feed(col, streams[c])
    per = {c: _fold(types.get(c, "").encode(), streams[c].digest()) for c in columns}
    return {"rows": rows, "columns": per, "digest": _fold(struct.pack("<Q", rows), *(f"{c}={d}".encode()
                                                                                  for c, d in sorted(per.items())))}


def _fold(*pieces: bytes) -> str:
    h = _h()
    for p in pieces:
        h.update(struct.pack("<Q", len(p)))
        h.update(p)
    return h.hexdigest()


def frame_table_digest(frame) -> dict:
    """The table digest of a polars frame about to be written (every column)."""
    return table_digest(frame.to_arrow().to_batches(max_chunksize=BATCH_ROWS), list(frame.columns))


def write_digested_parquet(frame, path: Path) -> int:
    """``frame`` to ``path`` atomically with its table digest in the file's metadata; returns bytes."""
    from eagle3_assets.files import write_parquet_atomic

    return write_parquet_atomic(frame, path, metadata={TABLE_KEY: json.dumps(frame_table_digest(frame))})


@dataclass
class TableReport:
    """The table digest recorded in a file against the file as it is now."""

    recorded: dict | None  # None: the file carries no table digest
    rows: int  # rows in the file now
    changed: list[str] = field(default_factory=list)  # columns whose values (or order) differ
    missing: list[str] = field(default_factory=list)  # columns recorded but gone

    @property
    def ok(self) -> bool:
        return self.recorded is not None and not self.changed and not self.missing and self.rows == self.recorded["rows"]

    def problem(self, path, writer: str) -> str:
        """One sentence: what differs from what ``writer`` (``asset[partition]``) wrote, and what to do."""
        if self.recorded is None:
            return (f"{path} carries no table digest (written before files had one, or rewritten by another tool): "
                    f"a row deleted, duplicated, moved or edited cannot be detected; re-materialize {writer}")
        what = []
        if self.rows != self.recorded["rows"]:
            what.append(f"it holds {self.rows:,} rows where {writer} wrote {self.recorded['rows']:,} (rows deleted or added)")
        if self.missing:
            what.append(f"columns {', '.join(self.missing)} are gone")
        if self.changed and self.rows == self.recorded["rows"]:
            moved = " (sample_id among them: rows moved, swapped or relabelled)" if "sample_id" in self.changed else ""
            what.append(f"column{'s' if len(self.changed) > 1 else ''} {', '.join(self.changed)} "
                        f"differ{'' if len(self.changed) > 1 else 's'} from what it wrote{moved}")
        return f"{path} is not the table {writer} wrote: " + "; ".join(what) + f"; re-materialize {writer}"


def verify_table_digest(path: Path | str, batch_rows: int = BATCH_ROWS) -> TableReport:
    """Recompute the table digest of the Parquet file at ``path`` over the columns it records."""
    import pyarrow.parquet as pq

    f = pq.ParquetFile(str(path))
    raw = (f.metadata.metadata or {}).get(TABLE_KEY.encode())
    rows = f.metadata.num_rows
    if raw is None:
        return TableReport(None, rows)
    recorded = json.loads(raw)
    have = set(f.schema_arrow.names)
    cols = [c for c in recorded["columns"] if c in have]
    now = table_digest(f.iter_batches(batch_size=batch_rows, columns=cols), cols) if cols else {"columns": {}}
    return TableReport(recorded, rows, changed=[c for c in cols if now["columns"][c] != recorded["columns"][c]],
                       missing=[c for c in recorded["columns"] if c not in have])


# ----------------------------------------------------------------------------- stale rows


@dataclass
class StaleReport:
    has_column: bool = True  # False: the file records no reply digests (written before rows carried them)
    rows: int = 0
    unrecorded: int = 0  # rows without a reply digest
    stale: int = 0  # rows whose reply line is no longer in the response files as it was
    first: list[dict] = field(default_factory=list)

    def names(self, n: int = SHOWN) -> str:
        shown = ", ".join(f"{r['dataset']}/{r['sample_id']} ({r['source']})" for r in self.first[:n])
        more = self.stale - min(n, len(self.first))
        return shown + (f" and {more:,} more" if more > 0 else "")


def stale_rows(path: Path | str, lines, keep: int = 10, batch_rows: int = BATCH_ROWS) -> StaleReport:
    """Token rows of the file at ``path`` whose reply (``response_digest``) is none of ``lines``, the
    response files' lines now: that reply was edited or removed after the row was built from it.
    The replies' digests are held as 16 bytes each (160 MB for ten million replies)."""
    import numpy as np
    import pyarrow.parquet as pq

    f = pq.ParquetFile(str(path))
    report = StaleReport(rows=f.metadata.num_rows)
    if RESPONSE_DIGEST_COLUMN not in f.schema_arrow.names:
        report.has_column = False
        return report
    held = bytearray()
    for line in lines:
        held += hashlib.blake2b(line, digest_size=16).digest()
    have = np.sort(np.frombuffer(bytes(held), dtype="S16"))
    cols = ["dataset", "sample_id", "source", RESPONSE_DIGEST_COLUMN]
    for batch in f.iter_batches(batch_size=batch_rows, columns=cols):
        digests = batch.column(RESPONSE_DIGEST_COLUMN).to_pylist()
        recorded = [i for i, d in enumerate(digests) if d]
        report.unrecorded += len(digests) - len(recorded)
        want = np.frombuffer(b"".join(bytes.fromhex(digests[i]) for i in recorded), dtype="S16")
        at = np.searchsorted(have, want)
        found = (at < len(have)) & (have[np.minimum(at, max(len(have) - 1, 0))] == want) if len(have) else \
            np.zeros(len(want), dtype=bool)
        for i in (recorded[k] for k in np.flatnonzero(~found)):
            report.stale += 1
            if len(report.first) < keep:
                report.first.append({c: batch.column(c)[i].as_py() for c in cols[:3]})
    return report
