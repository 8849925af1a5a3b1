"""The one role OpenRouter serves: generation over its chat completions, billed per token."""

from __future__ import annotations

from eagle3_assets.engines.roles import HttpGeneration


class OpenRouterGenerate:
    """Text replies (re-tokenized downstream), on someone else's GPUs: the step never waits for the pool."""

    in_process = False
    exact_ids = False
    gpu = False
    resources = ("openrouter",)

    def http(self, resources, spec, tokenizer, concurrency: int) -> HttpGeneration:
        from eagle3_assets.engines.http.client import client_config
        from eagle3_assets.engines.openrouter.backend import openrouter_backend

        r = resources.openrouter  # the model asked for is the target's served name (its OpenRouter slug)
        return HttpGeneration(openrouter_backend(r, spec.served_name), client_config(r),
                              concurrency or r.default_in_flight())


GENERATE = OpenRouterGenerate()
