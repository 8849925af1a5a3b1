"""The MLA drafter (``attention = "mla"``): the target's own multi-head latent attention
(DeepSeek-V3 / Kimi-K2.5) in the one EAGLE-3 layer (``attention.py``), exported as the DeepSeek
EAGLE-3 draft both engines load (``export.py``), its terms in the training memory estimate
(``memory.py``).

Its layout rule: neither engine's DeepSeek EAGLE-3 drafter (``Eagle3DeepseekV2ForCausalLM``) has
a norm over all of the features before ``fc``, so ``norm_before_fc`` is refused whatever the
engines. The EAGLE 3.1 switches are served by both (``SWITCH_READERS``): ``fc_norm`` (one RMSNorm per
aux layer before ``fc``, weights ``fc_norm.{i}.weight``) and ``norm_output`` (the final ``norm``'s
output is the hidden state the next draft position reads) are read from the config's top level by
SGLang's ``kimi_k25_eagle3.py`` and vLLM's ``deepseek_eagle3.py``. Its target rule: it copies the
target's MLA sizes, so it needs an MLA target.
"""

from __future__ import annotations

from eagle3_assets.drafter.export_files import SWITCH_KEYS, unread_switches
from eagle3_assets.drafter.kinds import AttentionMemory, DrafterKind
from eagle3_assets.drafter.kinds.mla import memory
from eagle3_assets.drafter.kinds.mla.attention import MLAAttention, mla_shape
from eagle3_assets.drafter.kinds.mla.export import check_mla_export, export_mla, is_mla_export, load_mla

# EAGLE 3.1 switch -> {engine: the module of its pinned release that reads it for this kind}
SWITCH_READERS = {key: {"sglang": "sglang.srt.models.kimi_k25_eagle3", "vllm": "vllm.model_executor.models.deepseek_eagle3"}
                  for key in SWITCH_KEYS}


def layout_problems(shape) -> dict[str, str]:
    """``{recipe key: problem}`` for the options of ``shape`` (a ``DraftShape``) an engine would not serve for MLA."""
    if shape.norm_before_fc:
        return {"norm_before_fc": "is for the Llama-style drafter: the MLA drafter's exports "
                                  "(Eagle3DeepseekV2ForCausalLM) carry no norm before fc"}
    return unread_switches(shape, SWITCH_READERS)


def target_notes(target_config: dict) -> list[str]:
    """Nothing to note on an MLA target (every engine serves it there); any other target raises."""
    from eagle3_assets.engines.versions import target_family

    if target_family(target_config) is None:
        raise ValueError("attention 'mla' needs an MLA target (DeepSeek-V3 / Kimi-K2.5 family); this target has no "
                         "kv_lora_rank: use attention 'llama'")
    return []


KIND = DrafterKind(
    name="mla",
    attention=MLAAttention,
    target_shape=mla_shape,
    layout_problems=layout_problems,
    target_notes=target_notes,
    export=export_mla,
    load=load_mla,
    check=check_mla_export,
    recognises=is_mla_export,
    memory=AttentionMemory(kernel=memory.kernel, step_bytes=memory.step_bytes, kept_keys_bytes=memory.kept_keys_bytes),
)
