"""One generation's result as the loopback generators return it, shared by the generators and
the tool-call replies that rewrite it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Output:
    output_ids: list[int]  # the stop token included when generation stopped on one
    finish_reason: str  # "stop" or "length"
    text: str
    prompt_tokens: int
