"""Per-dataset completion-token budget, enforced at admission.

A request reserves its ``max_tokens`` before it starts and settles with what it actually
used, so the budget holds even if every admitted request runs to its limit.
"""

from __future__ import annotations

from dataclasses import dataclass


class BudgetExhausted(Exception):
    pass


@dataclass
class TokenBudget:
    limit: int
    used: int = 0
    reserved: int = 0

    @property
    def remaining(self) -> int:
        return self.limit - self.used - self.reserved

    def try_reserve(self, tokens: int) -> bool:
        if tokens <= 0 or tokens > self.remaining:
            return False
        self.reserved += tokens
        return True

    def settle(self, reserved: int, actual: int) -> None:
        """Release a reservation and charge what was really produced."""
        if actual > reserved:
            raise ValueError(f"a request used {actual} tokens but reserved only {reserved}")
        self.reserved -= reserved
        self.used += actual

    def release(self, reserved: int) -> None:
        self.reserved -= reserved
