"""The bytes of a shard: storage dtypes (bf16, or fp8 e4m3 with one scale per token and tensor)
and a safetensors writer that streams chunks to disk and hashes them on the way."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

FP8_MAX = 448.0  # largest finite float8_e4m3fn

_ST_DTYPE = {"bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float32": "F32", "float16": "F16",
             "int64": "I64", "int32": "I32", "int8": "I8", "uint8": "U8"}

# ---- fp8 ------------------------------------------------------------------------------------

def quantize_fp8(x):
    """Per-token (row) e4m3 quantization: ``q = x / scale`` with ``scale = amax / 448``.

    e4m3 keeps 3 mantissa bits, so each element is off by at most 1/16 of the row's amax.
    """
    import torch

    x = x.float()
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float32)


def dequantize_fp8(q, scale, dtype=None):
    import torch

    out = q.to(torch.float32) * scale.to(torch.float32).unsqueeze(-1)
    return out.to(dtype) if dtype is not None else out


def encode_ids(input_ids, loss_mask) -> dict:
    """A sample's token ids (int32) and loss mask (int8) as storage tensors."""
    import torch

    return {
        "input_ids": torch.as_tensor(input_ids, dtype=torch.int32).cpu().contiguous(),
        "loss_mask": torch.as_tensor(loss_mask, dtype=torch.int8).cpu().contiguous(),
    }


def encode_sample(input_ids, loss_mask, aux, last, dtype: str) -> dict:
    """Storage tensors of one sample (CPU, contiguous, storage dtypes)."""
    import torch

    out = encode_ids(input_ids, loss_mask)
    if dtype == "bf16":
        out["aux_hidden"] = aux.detach().to("cpu", torch.bfloat16).contiguous()
        out["last_hidden"] = last.detach().to("cpu", torch.bfloat16).contiguous()
    else:
        for name, x in (("aux", aux), ("last", last)):
            q, s = quantize_fp8(x.detach())
            out[f"{name}_hidden"], out[f"{name}_scale"] = q.cpu().contiguous(), s.cpu().contiguous()
    return out


# ---- safetensors streaming writer -----------------------------------------------------------

def _raw(t):
    import torch

    return t.contiguous().view(torch.uint8).numpy().data if t.numel() else b""


def write_safetensors(path: Path, tensors: dict, metadata: dict[str, str]) -> tuple[int, str, int]:
    """Stream ``{name: (dtype, shape, [chunks])}`` into a safetensors file.

    Writes chunks one after another (no concatenated copy) and hashes them on the way.
    Tensors are laid out by element size, largest first, so each starts naturally aligned.
    Returns (file bytes, sha256 hex, tensor payload bytes).
    """
    order = sorted(tensors, key=lambda n: -tensors[n][0].itemsize)
    header: dict = {"__metadata__": metadata}
    pos = 0
    for name in order:
        dt, shape, chunks = tensors[name]
        n = sum(c.numel() for c in chunks) * dt.itemsize
        header[name] = {"dtype": _ST_DTYPE[str(dt).removeprefix("torch.")], "shape": list(shape),
                        "data_offsets": [pos, pos + n]}
        pos += n
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    h = hashlib.sha256()
    with open(path, "wb") as fh:
        for part in (struct.pack("<Q", len(blob)), blob):
            fh.write(part)
            h.update(part)
        for name in order:
            for c in tensors[name][2]:
                raw = _raw(c)
                fh.write(raw)
                h.update(raw)
        fh.flush()
        os.fsync(fh.fileno())
    return 8 + len(blob) + pos, h.hexdigest(), pos


def sha256_file(path: Path, block: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            h.update(chunk)
    return h.hexdigest()
