"""``torch.cuda.synchronize()`` as a no-op on a torch built without CUDA.

SGLang's K2.5 EAGLE-3 draft model (``models/kimi_k25_eagle3.py``, ``set_embed`` and
``set_embed_and_head``) and DeepSeek-V2's ``set_embed_and_head`` call it unconditionally after
sharing the target's embedding; on a CPU build of torch the call raises "Torch not compiled with
CUDA enabled". With no CUDA device there is no queued GPU work to wait for, so returning at once is
the call's meaning here. A torch that has CUDA keeps its own function.
"""

from __future__ import annotations

import torch


def _synchronize_nothing(device=None) -> None:
    """No CUDA in this torch: no stream has work to wait for."""


def install() -> bool:
    """Swap the no-op in where torch has no CUDA; says whether it did."""
    if torch.version.cuda is not None or torch.cuda.is_available():
        return False
    torch.cuda.synchronize = _synchronize_nothing
    return True


install()
