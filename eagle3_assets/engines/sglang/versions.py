"""SGLang's version rule: the one release the project supports, and what older releases lack.

Read from the published ``sglang`` wheels, file by file:

- 0.5.9: ``deepseek_v2.py`` captures EAGLE-3 layers, but ``kimi_k25.py`` does not forward
  ``set_eagle3_layers_to_capture`` to its language model, so a K2.5 target serves no EAGLE-3 draft;
- 0.5.10: it does (Llama-style drafts on K2.5);
- 0.5.12: ``kimi_k25_eagle3.py`` adds the MLA draft (``Eagle3DeepseekV2ForCausalLM``; it requires
  ``q_lora_rank``).

The rules every engine shares (the target family, the version parse, the refusal) are
:mod:`eagle3_assets.engines.versions`, which reads this module's ``REQUIREMENTS`` and ``pairing_problem``.
"""

from __future__ import annotations

from eagle3_assets.engines.versions import EngineVersionError, parse_version

# The one SGLang release the project supports: `make sglang` installs it, a server or a capture refuses
# any other (the capture calls ModelRunner's internals, which change between releases). The minimum
# versions below are facts about older releases, kept to explain a refusal.
SGLANG_VERSION = "0.5.23"

# what -> (first version that works, what older versions do)
REQUIREMENTS = {
    "eagle3": ((0, 5, 10), "SGLang {version} does not pass the EAGLE-3 capture layers through Kimi-K2.5's "
               "multimodal wrapper (kimi_k25.py, fixed in 0.5.10); use SGLang >= 0.5.10"),
    "mla_draft": ((0, 5, 12), "SGLang {version} has no MLA EAGLE-3 draft model (Eagle3DeepseekV2ForCausalLM "
                  "arrived in 0.5.12); use SGLang >= 0.5.12 or a Llama-style drafter"),
}


def gated(what: str, target_config: dict) -> bool:
    """Whether an older release's lack concerns this MLA target: plain DeepSeek-V3 captures in 0.5.9
    already; K2.5's wrapper is what lacked the pass-through."""
    return not (what == "eagle3" and target_config.get("model_type") != "kimi_k25")


def require_supported_sglang(version: str, where: str = "this environment") -> None:
    """Refuse any SGLang but :data:`SGLANG_VERSION`, before a server or a capture starts."""
    if parse_version(version) != parse_version(SGLANG_VERSION):
        raise EngineVersionError(f"SGLang {version} in {where}; this project supports SGLang {SGLANG_VERSION} "
                                 "(`make sglang` builds it; on a GPU box `pip install -e '.[sglang]'`)")


def pairing_problem(target_config: dict, drafter_config: dict, *, mla_target: bool, mla_drafter: bool,
                    cpu_build: bool = False) -> str | None:
    """What SGLang itself refuses of a drafter next to a target, or None."""
    if mla_drafter and not drafter_config.get("q_lora_rank"):
        return "SGLang's MLA draft model requires q_lora_rank in the drafter config"
    return None
