"""A digest per token row, written with it, so an id or mask changed after ``token_ids`` is seen.

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
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

DIGEST_COLUMN = "row_digest"
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
