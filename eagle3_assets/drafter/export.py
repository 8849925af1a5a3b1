"""Serving exports of a trained drafter, and loaders that rebuild it from those files alone, for
every drafter kind: each entry point looks the kind up in the registry (``drafter/kinds``) and
hands over, so this module names no kind.

- the kind of a model is its ``config.attention``; of an export, the kind that recognises its
  ``config.json`` (``kind_of_export``; the default, Llama-style kind judges an export none does);
- SGLang: ``--speculative-algorithm EAGLE3 --speculative-draft-model-path <dir>``;
- vLLM: ``vllm serve <dir>`` pairs it with the verifier (``verifier``, ``verifier_architectures``
  and ``speculative_tokens`` go to a kind that writes a speculators config).

The layouts themselves are the kinds' own: ``drafter/kinds/llama.py`` (``LlamaForCausalLMEagle3``
and speculators ``Eagle3Speculator``) and ``drafter/kinds/mla/`` (``Eagle3DeepseekV2ForCausalLM``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle3_assets.drafter.kinds import get_kind, kind_of_export
from eagle3_assets.drafter.model import Eagle3Drafter


def _export_config(export_dir: Path) -> dict:
    return json.loads((Path(export_dir) / "config.json").read_text())


def export_sglang(model: Eagle3Drafter, out_dir: Path, *, dtype: str = "bfloat16") -> Path:
    """``config.json`` + ``model.safetensors`` in the SGLang layout of the model's kind."""
    return get_kind(model.config.attention).export(model, out_dir, engine="sglang", dtype=dtype)


def export_vllm(model: Eagle3Drafter, out_dir: Path, *, dtype: str = "bfloat16", verifier: str = "",
                verifier_architectures: list[str] | None = None, speculative_tokens: int = 3) -> Path:
    """The vLLM checkpoint of the model's kind (a speculators config for the Llama-style drafter)."""
    return get_kind(model.config.attention).export(model, out_dir, engine="vllm", dtype=dtype, verifier=verifier,
                                                   verifier_architectures=verifier_architectures,
                                                   speculative_tokens=speculative_tokens)


def load_sglang(export_dir: Path, embeddings: torch.Tensor) -> Eagle3Drafter:
    """Rebuild the drafter from an SGLang export plus the target's embedding matrix."""
    return kind_of_export(_export_config(export_dir)).load(Path(export_dir), embeddings, engine="sglang")


def load_vllm(export_dir: Path, embeddings: torch.Tensor | None = None) -> Eagle3Drafter:
    """Rebuild the drafter from a vLLM export; its own embedding unless one is given."""
    return kind_of_export(_export_config(export_dir)).load(Path(export_dir), embeddings, engine="vllm")


def export_file_problems(export_dir: Path, engine: str) -> list[str]:
    """Problems with ``engine``'s export files (empty when its loader reads them as trained)."""
    export_dir = Path(export_dir)
    if not (export_dir / "config.json").exists() or not (export_dir / "model.safetensors").exists():
        return [f"{export_dir}: config.json or model.safetensors is missing"]
    return kind_of_export(_export_config(export_dir)).check(export_dir, engine)


def check_sglang_export(export_dir: Path, trained: dict | None = None) -> list[str]:
    """Problems with an SGLang export's files (empty when it follows the serving contract), and with
    its aux layer ids against ``trained`` (the training shards' ``layers`` record) when given."""
    from eagle3_assets.drafter.trained_layers import export_layer_problems

    return export_file_problems(export_dir, "sglang") + export_layer_problems(export_dir, "sglang", trained)


def check_vllm_export(export_dir: Path, trained: dict | None = None) -> list[str]:
    """Problems with a vLLM export's files (empty when vLLM reads it as trained), and with its aux
    layer ids against ``trained`` (the training shards' ``layers`` record) when given."""
    from eagle3_assets.drafter.trained_layers import export_layer_problems

    return export_file_problems(export_dir, "vllm") + export_layer_problems(export_dir, "vllm", trained)
