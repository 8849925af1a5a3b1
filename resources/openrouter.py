"""OpenRouter's OpenAI-compatible chat completions, for when the local box is too slow."""

import dagster as dg


class OpenRouterResource(dg.ConfigurableResource):
    """The API key comes from the environment (``OPENROUTER_API_KEY`` through ``EnvVar``); it is
    sent only in request headers and redacted from every log line, row and error."""

    api_key: str = ""
    base_url: str = "https://openrouter.ai/api/v1"
    provider: dict = {}  # routing: {"order": [...], "allow_fallbacks": false, ...}
    reasoning: dict = {}  # {"effort": "high"}, {"max_tokens": N}, {"enabled": false}
    usd_per_million_prompt: float = 0.0  # listed prices; only for the pre-run estimate
    usd_per_million_completion: float = 0.0
    connections_per_client: int = 10
    read_timeout_s: float = 900.0

    def backend(self, model: str):
        """The backend for ``model``, the target's served name (its OpenRouter slug)."""
        from eagle3_assets.generation.backends import OpenRouterBackend
        from eagle3_assets.generation.http_engine import Prices

        if not self.api_key:
            raise ValueError("no OpenRouter API key: set OPENROUTER_API_KEY where the code location runs, then reload it")
        prices = None
        if self.usd_per_million_prompt or self.usd_per_million_completion:
            prices = Prices.per_million(self.usd_per_million_prompt, self.usd_per_million_completion)
        return OpenRouterBackend(self.api_key, model, provider=self.provider or None,
                                 reasoning=self.reasoning or None, base_url=self.base_url, prices=prices)

    def client_config(self):
        from eagle3_assets.generation.http_engine import ClientConfig

        return ClientConfig(connections_per_client=self.connections_per_client, read_timeout_s=self.read_timeout_s)
