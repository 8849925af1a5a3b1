"""Where and in which precision this process runs the target: ``auto`` settings resolved per machine.

``device: auto`` is ``cuda`` where torch sees a GPU, else ``cpu``; ``dtype: auto`` is ``bfloat16``
on a GPU (float32 runs about a tenth as fast there) and ``float32`` on a CPU (where bf16 matmuls are
slow and the reference tests compare float32). A job launched elsewhere (SLURM, torchrun) carries
``auto`` in its job file and resolves it on the node it runs on, not where it was written.
"""

from __future__ import annotations

ALIASES = {"bf16": "bfloat16", "fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16"}
DTYPES = ("bfloat16", "float32", "float16")


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def resolve_device(device: str | None = "auto") -> str:
    """``auto`` (or empty): ``cuda`` where a GPU is visible, else ``cpu``; anything else as given."""
    device = (device or "auto").strip()
    if device == "auto":
        return "cuda" if cuda_available() else "cpu"
    return device


def resolve_dtype(dtype: str | None = "auto", device: str | None = "auto") -> str:
    """A torch dtype name: ``auto`` is ``bfloat16`` on a GPU (``device`` resolved first), ``float32``
    on a CPU; ``bf16``/``fp32``/``fp16`` are accepted for their long names."""
    name = (dtype or "auto").strip().lower()
    if name == "auto":
        return "float32" if resolve_device(device).split(":")[0] == "cpu" else "bfloat16"
    name = ALIASES.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"target dtype {dtype!r} is not one of auto, {', '.join(DTYPES)} (or bf16, fp32, fp16)")
    return name
