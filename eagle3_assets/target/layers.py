"""Which target layers EAGLE-3 captures, and what a layer id means.

Ids follow SGLang/SpecForge: id ``k`` is the *output of decoder layer k* (0-based), i.e. the
residual stream entering layer ``k + 1``. The default for a target with ``L`` layers is
``[1, L//2 - 1, L - 4]`` (SpecForge ``resolve_eagle_capture_layers``; SGLang's own default
``[2, L//2, L-3]`` counts "entering" layers and names the same tensors); Kimi-K2.5's 61 layers
give [1, 29, 57]. vLLM/speculators ids are ours + 1. Ids must start at 1: SGLang reads ids that
do not as "entering" ids (see ``sglang_shift_problem``). Getting this wrong silently trains a
drafter on the wrong layers, so the manifest records the convention and the HF index each id was read from.

Hugging Face ``output_hidden_states`` (verified on transformers 5.24, Llama, by
``tests/unit/hidden_states/test_hidden_states.py``): ``hidden_states[0]`` is the embeddings, ``hidden_states[k+1]``
is the output of decoder layer ``k`` for ``k <= L-2``, and ``hidden_states[L]`` (= ``[-1]``) is
*post-norm*: transformers 5 overwrites the last entry with ``last_hidden_state``
(``capture_outputs(tie_last_hidden_states=True)``). The raw output of layer ``L-1`` is therefore
not available there; the final state EAGLE-3 stores is that post-norm one, the lm_head input.
"""

from __future__ import annotations

from eagle3_assets.target.config import text_config

N_AUX = 3
CONVENTION_NAME = "output_of_layer"


def num_layers(config) -> int:
    """Decoder layer count of an HF config (or a plain int), text config first for VLMs."""
    if isinstance(config, int):
        return config
    text = text_config(config)
    n = getattr(text, "num_hidden_layers", None)
    if n is None:
        raise ValueError(f"{type(config).__name__} has no num_hidden_layers")
    return int(n)


def default_layer_ids(config) -> list[int]:
    """SpecForge/SGLang default aux layers: outputs of layers ``[1, L//2 - 1, L - 4]``."""
    n = num_layers(config)
    if n < 5:
        raise ValueError(f"EAGLE-3 default aux layers need at least 5 decoder layers, got {n}")
    return [1, n // 2 - 1, n - 4]


def resolve_layer_ids(config, override: list[int] | None = None) -> list[int]:
    """Explicit ids win (e.g. a draft config's ``eagle_aux_hidden_state_layer_ids``), checked."""
    n = num_layers(config)
    ids = [int(i) for i in override] if override is not None else default_layer_ids(n)
    if len(ids) != N_AUX:
        raise ValueError(f"EAGLE-3 captures exactly {N_AUX} aux layers, got {ids}")
    for i in ids:
        if not 0 <= i < n:
            raise ValueError(f"aux layer id {i} is outside 0..{n - 1} for a {n}-layer target")
    if sorted(set(ids)) != ids:
        raise ValueError(f"aux layer ids must be strictly increasing, got {ids}")
    sglang_shift_problem(ids, raise_error=True)
    return ids


def sglang_shift_problem(ids: list[int], *, raise_error: bool = False) -> str | None:
    """Why SGLang would capture other layers than ``ids`` name, or None.

    SGLang's ``set_eagle3_layers_to_capture`` turns "output of layer k" ids into "entering layer
    k + 1" only when the first id is 1 (since sgl-project/sglang#25454; older versions always
    shift). Ids that start elsewhere are read unshifted by a new SGLang and shifted by an old one,
    so at serve time the target captures the layer before the one the drafter was trained on.
    The default ids start at 1; other ids are refused rather than silently moved."""
    if ids and ids[0] != 1:
        msg = (f"aux layer ids {list(ids)} do not start at 1: SGLang (since PR #25454) shifts ids to "
               "'output of layer k' only when the first id is 1, so it would capture layers "
               f"{[i - 1 for i in ids]} at serve time while older versions capture {list(ids)}; "
               "use ids that start at 1 (the default [1, L//2-1, L-4] does)")
        if raise_error:
            raise ValueError(msg)
        return msg
    return None


def vllm_shift_problem(vllm_ids: list[int]) -> str | None:
    """:func:`sglang_shift_problem` for a vLLM export, worded in vLLM's own numbering (speculators
    ids are the output-of-layer id + 1, so they must start at 2), or None."""
    if vllm_ids and vllm_ids[0] != 2:
        return (f"eagle_aux_hidden_state_layer_ids {list(vllm_ids)} (vLLM's numbering, output-of-layer id + 1) do not "
                f"start at 2: they name the outputs of layers {[i - 1 for i in vllm_ids]}, which SGLang would not "
                "serve as named (it shifts ids only when the first is 1), so one drafter would be served on "
                "different layers by the two engines; use ids that start at 2 here (the default [2, L//2, L-3] does)")
    return None


def hf_hidden_states_index(layer_id: int, n_layers: int) -> int:
    """Index into HF ``output_hidden_states`` holding the output of decoder layer ``layer_id``."""
    if not 0 <= layer_id < n_layers:
        raise ValueError(f"layer id {layer_id} is outside 0..{n_layers - 1}")
    if layer_id == n_layers - 1:
        raise ValueError(
            f"the output of the last layer ({layer_id}) is not in HF hidden_states: transformers 5 "
            "replaces hidden_states[-1] with the post-norm state; hook the layer instead"
        )
    return layer_id + 1


def to_speculators_ids(layer_ids: list[int]) -> list[int]:
    """The same layers in vLLM/speculators numbering (0 = embeddings)."""
    return [i + 1 for i in layer_ids]


def convention(layer_ids: list[int], n_layers: int) -> dict:
    """The layer description recorded in the hidden-state manifest."""
    return {
        "aux_layer_ids": list(layer_ids),
        "num_hidden_layers": n_layers,
        "convention": CONVENTION_NAME,
        "meaning": "id k = output of decoder layer k (0-based) = residual stream entering layer k+1",
        "hf_hidden_states_index": [i + 1 if i < n_layers - 1 else None for i in layer_ids],
        "sglang_layer_ids": list(layer_ids),
        "speculators_layer_ids": to_speculators_ids(layer_ids),
        "aux_layout": "concat of the aux layers along the feature axis, in id order: [T, 3H]",
        "final": "post_norm",
        "final_meaning": "model.norm(output of the last decoder layer): the lm_head input, "
        "HF hidden_states[-1] in transformers 5",
    }
