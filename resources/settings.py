"""Per-dataset settings shared by generation, inventory and the checks."""


import dagster as dg


class DatasetSettings(dg.ConfigurableResource):
    """Token budgets, split and check thresholds, so every asset and check agrees on them."""

    default_budget_tokens: int = 10_000_000
    budget_tokens: dict[str, int] = {}
    eval_fraction: float = 0.1
    consistency_threshold: float = 0.995
    max_truncation_rate: float = 0.2

    def budget_for(self, dataset: str) -> int:
        return int(self.budget_tokens.get(dataset, self.default_budget_tokens))
