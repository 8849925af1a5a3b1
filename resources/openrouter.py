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

    def backend(self, model: str):
        """The backend for ``model``, the target's served name (its OpenRouter slug)."""
        from eagle3_assets.generation.backends import OpenRouterBackend
        from eagle3_assets.generation.http_config import Prices

        key = self.resolved_api_key()
        if not key:
            raise ValueError(f"no OpenRouter API key: set {self.api_key_env} where the code location runs, "
                             "then reload it")
        prices = None
        if self.usd_per_million_prompt or self.usd_per_million_completion:
            prices = Prices.per_million(self.usd_per_million_prompt, self.usd_per_million_completion)
        return OpenRouterBackend(key, model, provider=self.provider or None,
                                 reasoning=self.reasoning or None, base_url=self.base_url, prices=prices)

    def default_in_flight(self) -> int:
        return self.max_in_flight

    def client_config(self):
        from eagle3_assets.generation.http_config import ClientConfig

        return ClientConfig(connections_per_client=self.connections_per_client, read_timeout_s=self.read_timeout_s)
