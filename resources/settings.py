"""Per-dataset settings shared by generation, inventory and the checks."""


import dagster as dg


class DatasetSettings(dg.ConfigurableResource):
    """Token budgets, split and check thresholds, so every asset and check agrees on them."""

    default_budget_tokens: int = 10_000_000
    budget_tokens: dict[str, int] = {}
    eval_fraction: float = 0.1
    consistency_threshold: float = 0.995
    max_truncation_rate: float = 0.2
    # Tokens each prompt must leave free in the target's context for its reply: the prompts asset
    # refuses (or skips, or truncates) prompts longer than context - reserve, before any generation.
    # Set it to the max_new_tokens you generate with (raw_responses' default is 256).
    default_context_reserve: int = 256
    context_reserve: dict[str, int] = {}

    def budget_for(self, dataset: str) -> int:
        return int(self.budget_tokens.get(dataset, self.default_budget_tokens))

    def context_reserve_for(self, dataset: str) -> int:
        return int(self.context_reserve.get(dataset, self.default_context_reserve))
