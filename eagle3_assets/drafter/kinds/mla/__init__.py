"""The MLA drafter (``attention = "mla"``): the target's own multi-head latent attention
(DeepSeek-V3 / Kimi-K2.5) in the one EAGLE-3 layer (``attention.py``), its terms in the training
memory estimate (``memory.py``); its exports, the DeepSeek EAGLE-3 draft, are its serving formats
(``drafter/formats/mla_*.py``).

Its layout rule: no engine's DeepSeek EAGLE-3 drafter (``Eagle3DeepseekV2ForCausalLM``) has a norm
over all of the features before ``fc``, so ``norm_before_fc`` is refused whatever the engines (the
EAGLE 3.1 switches are each format's ``switch_readers``). Its target rule: it copies the target's
MLA sizes, so it needs an MLA target.
"""

from __future__ import annotations

from eagle3_assets.drafter.kinds import AttentionMemory, DrafterKind
from eagle3_assets.drafter.kinds.mla import memory
from eagle3_assets.drafter.kinds.mla.attention import MLAAttention, mla_shape


def layout_problems(shape) -> dict[str, str]:
    """``{recipe key: problem}`` for the options of ``shape`` (a ``DraftShape``) no engine would serve for MLA."""
    if shape.norm_before_fc:
        return {"norm_before_fc": "is for the Llama-style drafter: the MLA drafter's exports "
                                  "(Eagle3DeepseekV2ForCausalLM) carry no norm before fc"}
    return {}


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
    memory=AttentionMemory(kernel=memory.kernel, step_bytes=memory.step_bytes, kept_keys_bytes=memory.kept_keys_bytes),
)
