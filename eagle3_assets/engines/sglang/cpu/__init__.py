"""What SGLang's own Python needs to run on a CPU without its CUDA kernel library.

SGLang 0.5.23 ships only CUDA builds of its kernels (``sglang-kernel``), and PyPI's torchvision is a
CUDA build too. ``make sglang`` installs SGLang's Python and the Python half of ``sgl_kernel``; the
folder :data:`HOOK_DIR` goes first on a server's ``PYTHONPATH`` and replaces these:

- ``sitecustomize.py`` declares the schemas of torchvision's ``nms`` / ``qnms`` ops (no kernels), so
  torchvision's pure-Python parts import: SGLang imports them indirectly and never calls them here;
- ``common_ops.py`` stands for sgl_kernel's compiled library: it registers no op, so SGLang takes
  its native-torch paths (on a CPU without AMX it logs that and falls back by itself);
- ``sgl_kernel_cpu_ops.py``, ``sgl_kernel_attention_ops.py`` and ``sgl_kernel_spec_ops.py`` register, under
  sgl_kernel's own names, plain-torch versions of the ops only a CPU-built sgl_kernel has and SGLang's
  CPU engine calls: the KV-pool move, the ``intel_amx`` backend's decode/extend attention and the
  EAGLE worker's tree and cache-location ops (each tested against SGLang's own definition).

Everything else that runs is SGLang's own code.
"""

from __future__ import annotations

import os
from pathlib import Path

HOOK_DIR = Path(__file__).resolve().parent / "hook"


def server_environment(base: dict | None = None) -> dict:
    """``base`` (default: this process's environment) with :data:`HOOK_DIR` first on ``PYTHONPATH``."""
    env = dict(os.environ if base is None else base)
    parts = [str(HOOK_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def enable_in_process() -> bool:
    """What :func:`server_environment` gives a server, for this process: SGLang's CPU engine and the
    folder :data:`HOOK_DIR` first on ``sys.path``, its ``sitecustomize`` run. Called before SGLang is
    imported, on a machine without CUDA (a streaming producer's one-rank capture, started by a launcher
    that knows nothing of CPUs); False, and nothing changed, where CUDA is present or it already ran."""
    import importlib.util
    import sys

    import torch

    if torch.cuda.is_available() or str(HOOK_DIR) in sys.path:
        return False
    if "sglang" in sys.modules or "torchvision" in sys.modules:
        raise RuntimeError("SGLang's CPU support must be enabled before SGLang or torchvision is imported")
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    sys.path.insert(0, str(HOOK_DIR))
    spec = importlib.util.spec_from_file_location("eagle3_sglang_cpu_hook", HOOK_DIR / "sitecustomize.py")
    hook = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # kept: its op library lives with it
    spec.loader.exec_module(hook)
    return True
