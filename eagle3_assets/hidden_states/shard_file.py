"""Rows of one safetensors shard, read with ``pread`` into fresh memory.

``safetensors.safe_open`` maps the whole file and hands out views of the mapping: every
page a reader touches then counts toward the process's RSS for as long as the file stays
open, so a trainer walking a 4.6 TB corpus would report the corpus as its memory. Reading
just the requested rows with ``os.preadv`` into a new buffer keeps the process at the size
of the batches it holds (the page cache still does its job, outside the process).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn,
          "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8}


class ShardFile:
    """One open shard: its header parsed once, rows ``[a, b)`` of any tensor on demand."""

    def __init__(self, path: Path | str):
        self.path = str(path)
        self.fd = os.open(self.path, os.O_RDONLY)
        (n,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
        header = json.loads(os.pread(self.fd, n, 8))
        self.metadata = header.pop("__metadata__", None) or {}
        self.tensors = header
        self.base = 8 + n

    def keys(self) -> list[str]:
        return list(self.tensors)

    def rows(self, name: str, a: int, b: int) -> torch.Tensor:
        info = self.tensors[name]
        dtype, shape = DTYPES[info["dtype"]], info["shape"]
        row = math.prod(shape[1:]) * dtype.itemsize
        a, b = max(0, a), min(b, shape[0])
        buf = torch.empty(max(0, b - a) * row, dtype=torch.uint8)
        view, offset, done = memoryview(buf.numpy()), self.base + info["data_offsets"][0] + a * row, 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"{self.path}: {name} ends early (shard truncated?)")
            done += got
        return buf.view(dtype).reshape(max(0, b - a), *shape[1:])

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        try:
            self.close()
        except OSError:
            pass
