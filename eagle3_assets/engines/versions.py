"""What every engine's version rule shares: the target family that is gated, the version parse, the
refusal, and the lookup of an engine's own rule (``eagle3_assets/engines/<engine>/versions.py``:
its ``REQUIREMENTS``, ``gated`` and ``pairing_problem``).

A DeepSeek-V3-family target (DeepSeek-V3, Kimi-K2, Kimi-K2.5: MLA attention) is recent in every
engine; Llama-family targets work in every version the project supports. The facts per release are
in the engines' own modules (``engines/sglang/versions.py``, ``engines/vllm/versions.py``).
"""

from __future__ import annotations

import importlib
import re

from eagle3_assets.target.config import text_config

MLA_FAMILIES = ("deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25")


class EngineVersionError(RuntimeError):
    """A serving engine too old for what is asked of it; the message says which version works."""


def parse_version(text: str) -> tuple[int, int, int]:
    parts = [int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


def engine_rule(engine: str):
    """The engine's own version rule, ``eagle3_assets.engines.<engine>.versions``."""
    return importlib.import_module(f"eagle3_assets.engines.{engine}.versions")


def target_family(config: dict) -> str | None:
    """``"DeepSeek-V3-family (<model_type>)"`` for an MLA target (K2.5's wrapper included), else None."""
    text = text_config(config)
    kinds = {config.get("model_type"), text.get("model_type")}
    if text.get("kv_lora_rank") is not None or kinds & set(MLA_FAMILIES):
        return f"DeepSeek-V3-family ({text.get('model_type') or config.get('model_type')})"
    return None


def version_problem(engine: str, version: str, what: str, target_config: dict) -> str | None:
    """Why ``engine`` at ``version`` cannot do ``what`` ("eagle3", "extract", "mla_draft") for this
    target, or None. Only DeepSeek-V3-family targets are gated (Llama-family ones work in every
    version the project supports)."""
    family = target_family(target_config)
    rule = engine_rule(engine)
    if family is None or what not in rule.REQUIREMENTS:
        return None
    first, message = rule.REQUIREMENTS[what]
    if parse_version(version) >= first or not rule.gated(what, target_config):
        return None
    return message.format(version=version, family=family)


def mla_draft_problem(engine: str, version: str) -> str | None:
    """Why ``engine`` at ``version`` has no MLA EAGLE-3 draft model (``Eagle3DeepseekV2ForCausalLM``), or None.
    An MLA drafter only ever serves next to an MLA target, so no target config is needed."""
    first, message = engine_rule(engine).REQUIREMENTS["mla_draft"]
    if parse_version(version) >= first:
        return None
    return message.format(version=version, family="DeepSeek-V3-family")


def check_version(engine: str, version: str, what: str, target_config: dict) -> None:
    problem = version_problem(engine, version, what, target_config)
    if problem:
        raise EngineVersionError(problem)


def pairing_problem(target_config: dict, drafter_config: dict, *, engine: str, cpu_build: bool = False) -> str | None:
    """Why ``engine`` cannot serve this drafter export next to this target, or None."""
    mla_target = target_family(target_config) is not None
    mla_drafter = drafter_config.get("architectures") == ["Eagle3DeepseekV2ForCausalLM"]
    if mla_drafter and not mla_target:
        return "an MLA drafter (Eagle3DeepseekV2ForCausalLM) needs an MLA target (DeepSeek-V3 family)"
    return engine_rule(engine).pairing_problem(target_config, drafter_config, mla_target=mla_target,
                                               mla_drafter=mla_drafter, cpu_build=cpu_build)
