"""Sample identity: one id per (dataset, prompt, generation settings that change the output).

The id never depends on the backend, so a dataset started on one source can continue on
another and a finished sample is never generated twice. ``max_tokens`` is deliberately not
part of it: a response cut by the length limit is data, not a reason to buy it again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class SamplingSettings:
    target: str  # the target model's name, shared by every backend that serves it
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    samples_per_prompt: int = 1

    def identity(self, sample_index: int) -> dict:
        """The fields that change what the target writes for one sample."""
        ident = {"target": self.target, "index": sample_index}
        if self.temperature > 0:  # greedy decoding ignores seed and top_p
            ident.update(temperature=self.temperature, top_p=self.top_p, seed=self.seed)
        return ident

    def as_dict(self) -> dict:
        return asdict(self)


def sample_id(dataset: str, prompt_id: str, identity: dict) -> str:
    canon = json.dumps([dataset, prompt_id, identity], sort_keys=True, separators=(",", ":"))
    return "s" + hashlib.sha256(canon.encode("utf-8")).hexdigest()[:20]


@dataclass(frozen=True)
class SampleRequest:
    sample_id: str
    dataset: str
    prompt_id: str
    sample_index: int
    messages: list
    tools: list | None = None  # the prompt's declarations (OpenAI shape), sent to or rendered for the target

    def render(self, render_prompt) -> list[int]:
        """The prompt's ids by ``render_prompt(messages[, tools])`` (the target's chat template)."""
        return list(render_prompt(self.messages, self.tools) if self.tools else render_prompt(self.messages))


def plan_samples(dataset: str, prompts, settings: SamplingSettings) -> list[SampleRequest]:
    """Every sample the dataset should eventually hold, in prompt order."""
    out = []
    for p in prompts:
        for k in range(settings.samples_per_prompt):
            sid = sample_id(dataset, p.prompt_id, settings.identity(k))
            out.append(SampleRequest(sid, dataset, p.prompt_id, k, p.messages, p.tools))
    return out
