"""Which serving engine runs which drafter layout exactly as it was trained.

Read from the engines' EAGLE-3 Llama drafters (SGLang ``models/llama_eagle3.py``, vLLM 0.32
``model_executor/models/llama_eagle3.py`` + ``transformers_utils/configs/speculators/algos.py``):

- ``norm_before_fc``: vLLM reads ``norm_before_fc`` from a speculators config and applies one
  RMSNorm (``input_norm.weight``) over the concatenated [3H] features before ``fc``. SGLang's
  ``LlamaForCausalLMEagle3`` runs ``fc`` on the raw features and has no such weight: it would
  load the export and silently run another network.
- more than one decoder layer: both engines build extra layers, but differently (vLLM carries
  the residual stream into them, SGLang feeds them the MLP output alone), so no trained network
  is served the same by both; this trainer builds one layer.

- ``norm_before_fc`` with ``attention = "mla"``: neither engine's DeepSeek EAGLE-3 drafter
  (``Eagle3DeepseekV2ForCausalLM``) has the norm.

A recipe lists the engines its exports are for (``engines``, both by default); a layout one of
them would run differently is refused when the recipe is loaded.
"""

from __future__ import annotations

# option -> (engine that cannot serve it, why), for options that are on
UNSERVED = {
    "norm_before_fc": ("sglang", "SGLang's LlamaForCausalLMEagle3 has no norm before fc and would run fc on the raw "
                                 "features; set engines = [\"vllm\"] to export this drafter for vLLM alone"),
}


def layout_problems(shape) -> dict[str, str]:
    """``{recipe key: problem}`` for the options of ``shape`` (a ``DraftShape``) that one of its
    ``engines`` would not run as trained."""
    problems = {}
    if shape.norm_before_fc and shape.attention == "mla":
        problems["norm_before_fc"] = ("is for the Llama-style drafter: the MLA drafter's exports (Eagle3DeepseekV2ForCausalLM) "
                                      "carry no norm before fc")
        return problems
    for key, (engine, why) in UNSERVED.items():
        if getattr(shape, key) and engine in shape.engines:
            problems[key] = f"cannot be served by {engine}: {why}"
    return problems
