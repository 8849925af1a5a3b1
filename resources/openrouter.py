"""OpenRouter's OpenAI-compatible chat completions, for when the local box is too slow."""

import os

import dagster as dg


class OpenRouterResource(dg.ConfigurableResource):
    """The API key comes from the environment: ``api_key`` is bound to ``OPENROUTER_API_KEY``
    through ``EnvVar`` and, when a run-config override of any other field leaves it empty, is read
    from the variable named by ``api_key_env`` where the step runs. It is sent only in request
    headers and redacted from every log line, row and error.

    ``max_in_flight`` is the run's one gate: requests in flight for every dataset of a run
    together (a single-run backfill of eight datasets shares it)."""

    api_key: str = ""
    api_key_env: str = "OPENROUTER_API_KEY"
    base_url: str = "https://openrouter.ai/api/v1"
    provider: dict = {}  # routing: {"order": [...], "allow_fallbacks": false, ...}
    reasoning: dict = {}  # {"effort": "high"}, {"max_tokens": N}, {"enabled": false}
    usd_per_million_prompt: float = 0.0  # listed prices; only for the pre-run estimate
    usd_per_million_completion: float = 0.0
    max_in_flight: int = 2000
    connections_per_client: int = 10
    read_timeout_s: float = 900.0

    def resolved_api_key(self) -> str:
        return self.api_key or os.environ.get(self.api_key_env, "")

    def default_in_flight(self) -> int:
        return self.max_in_flight
