"""The wire every HTTP engine's backend shares with the generation stage's HTTP engine.

A backend (``engines/sglang/backend.py``, ``engines/openrouter/backend.py``,
``engines/vllm/openai_ids.py``) turns a ``SampleRequest`` into an HTTP request (``prepare`` once,
``request`` per attempt) and a reply into an ``Outcome`` plus, when it is kept, a response row with
every key of the generation stage's ``RESPONSE_FIELDS`` (:class:`Prepared`, :class:`Parsed`). It
also knows its pre-run checks (``preflight``, raising :class:`BackendUnavailable`), what to put in
client headers, and how to ``redact`` its secret from any text (:func:`redactor`).

Rows also carry ``reasoning_tokens``, ``native_finish_reason`` and ``generation_id``; the
current row contract (``RESPONSE_FIELDS``) does not persist them, the engine's report sums them.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from eagle3_assets.engines.http.classify import Outcome
from eagle3_assets.engines.http.samples import SampleRequest, SamplingSettings

FINISH = {"stop": "stop", "eos": "stop", "end_turn": "stop", "stop_sequence": "stop", "tool_calls": "stop",
          "function_call": "stop", "length": "length", "max_tokens": "length"}


@dataclass
class Prepared:
    req: SampleRequest
    prompt_ids: list[int] | None
    payload: dict
    body: bytes | None = None  # encoded once when it does not change between attempts


@dataclass
class Parsed:
    outcome: Outcome
    row: dict | None = None
    cost_usd: float | None = None  # billed for this attempt, kept row or not
    flags: tuple = ()


def sample_seed(sampling: SamplingSettings, req: SampleRequest) -> int:
    """A per-sample seed that depends only on the settings and the sample id."""
    try:
        h = int(req.sample_id.lstrip("s")[:8], 16)
    except ValueError:
        h = sum(req.sample_id.encode())
    return (sampling.seed * 1_000_003 + h) % (2**31 - 1)


def base_row(req: SampleRequest, source: str) -> dict:
    return {"sample_id": req.sample_id, "dataset": req.dataset, "prompt_id": req.prompt_id,
            "sample_index": req.sample_index, "source": source}


def redactor(*secrets: str | None) -> Callable[[str], str]:
    secrets = tuple(s for s in secrets if s)

    def redact(text) -> str:
        text = "" if text is None else str(text)
        for s in secrets:
            if s in text:
                text = text.replace(s, "***")
        return text

    return redact


class BackendUnavailable(RuntimeError):
    """The backend failed its pre-run health check."""


def now_iso() -> str:
    """A row's ``created_at``: UTC, to the second."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def key_id(api_key: str) -> str:
    """A fingerprint that tells keys apart without revealing them."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:12]
