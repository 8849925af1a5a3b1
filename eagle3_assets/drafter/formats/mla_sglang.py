"""The MLA drafter for SGLang: the DeepSeek EAGLE-3 draft (``mla_layout.py``) as SGLang's
``models/deepseek_eagle3.py`` loads it: the aux ids in SGLang's numbering (the project's) in
``eagle_config`` only, no ``embed_tokens`` (it takes the target's), ``q_lora_rank`` required, and
written only when the supported SGLang release has the MLA draft model. It reads both EAGLE 3.1
switches (``models/kimi_k25_eagle3.py``; ``fc_norm`` also as ``use_aux_norm``).
"""

from __future__ import annotations

from eagle3_assets.drafter.export_files import SWITCH_KEYS
from eagle3_assets.drafter.formats.mla_layout import MlaTraits, mla_format

ENGINE = "sglang"


def require_sglang_mla_draft(version: str | None = None) -> None:
    """The SGLang the export is for (the one the project supports) must have the MLA draft model."""
    from eagle3_assets.engines.sglang.versions import SGLANG_VERSION
    from eagle3_assets.engines.versions import EngineVersionError, mla_draft_problem

    problem = mla_draft_problem(ENGINE, version or SGLANG_VERSION)
    if problem:
        raise EngineVersionError(f"cannot export an MLA drafter for SGLang: {problem}")


TRAITS = MlaTraits(engine=ENGINE, needs_q_lora_rank=True, aux_norm_alias=True, before_export=require_sglang_mla_draft)
FORMAT = mla_format(TRAITS, switch_readers={key: "sglang.srt.models.kimi_k25_eagle3" for key in SWITCH_KEYS},
                    aux_ids=lambda config: (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
