"""The MLA drafter for vLLM: the DeepSeek EAGLE-3 draft (``mla_layout.py``) as vLLM 0.32's
``model_executor/models/deepseek_eagle3.py`` loads it: the aux ids in vLLM's numbering (the
project's + 1) at the top level, where vLLM reads them first, and in ``eagle_config``;
``norm_before_residual: false`` said outright (vLLM's default is on); ``embed_tokens.weight``
carried (equal to the target's, so vLLM shares the target's). It reads both EAGLE 3.1 switches.
"""

from __future__ import annotations

from eagle3_assets.drafter.export_files import SWITCH_KEYS
from eagle3_assets.drafter.formats.mla_layout import MlaTraits, mla_format

TRAITS = MlaTraits(engine="vllm", carries_embeddings=True, top_level_ids=True)
FORMAT = mla_format(TRAITS, switch_readers={key: "vllm.model_executor.models.deepseek_eagle3" for key in SWITCH_KEYS},
                    aux_ids=lambda config: config.get("eagle_aux_hidden_state_layer_ids",
                                                      (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")))
