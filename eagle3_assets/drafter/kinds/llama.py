"""The Llama-style drafter (``attention = "llama"``, the default): GQA attention (``drafter/model.py``'s
``Attention``), the kind every engine serves. It copies no target sizes and refuses no layout of its
own: what an engine would not run as trained, and its exports, are its serving formats'
(``drafter/formats/llama_*.py``). A recipe lists the engines its exports are for (``engines``, all
by default); a layout one of them would run differently is refused when the recipe is loaded.

More than one decoder layer is not built: the engines build extra layers differently, so no trained
network would be served the same by all of them.
"""

from __future__ import annotations

from eagle3_assets.drafter.kinds import DrafterKind
from eagle3_assets.drafter.model import Attention

KIND = DrafterKind(
    name="llama",
    attention=Attention,
    target_shape=None,
    layout_problems=lambda shape: {},
    target_notes=lambda target_config: [],
)
