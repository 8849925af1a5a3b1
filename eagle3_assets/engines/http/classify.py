"""What one HTTP reply means for the engine: keep it, retry it, fail the sample, or stop the run.

Pure functions over (status, body, headers) and transport exceptions, shared by every backend.
OpenRouter's contract: an error may come as an HTTP status, as an ``error`` object in a 200 body,
or as ``finish_reason: "error"``; 401 and credit or key-limit 402s stop the run; 429 and in-flight
402s pause every worker. SGLang's: ``meta_info.finish_reason.type == "abort"`` with a status code.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class Outcome:
    """What to do with one reply: ``ok`` (keep), ``retry``, ``fail`` (this sample, non-retryable)
    or ``stop`` (the whole run: bad key, no credits)."""

    kind: str
    reason: str
    retry_after: float | None = None
    cooldown: bool = False  # every worker pauses (rate limits, in-flight budget)
    message: str = ""
    status: int | None = None

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


def parse_json(body) -> tuple[Any, bool]:
    if isinstance(body, (dict, list)) or body is None:
        return body, body is not None
    if isinstance(body, (bytes, bytearray)):
        body = bytes(body).decode("utf-8", errors="replace")
    text = str(body).strip()  # OpenRouter may send blank-line heartbeats before the JSON
    if not text:
        return None, False
    try:
        return json.loads(text), True
    except ValueError:
        return None, False


def parse_retry_after(value) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date)."""
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except (TypeError, ValueError):
        pass
    try:
        when = email.utils.parsedate_to_datetime(str(value))
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time()) if when else None


def _error_message(err) -> str:
    if isinstance(err, dict):
        msg = err.get("message")
        return (msg if isinstance(msg, str) else json.dumps(msg))[:500] if msg is not None else ""
    return str(err)[:500] if err else ""


MISSING_REASONING = "prompt_missing_history_reasoning"  # the prompt file's fault: a row, not the backend


def names_missing_reasoning(message: str) -> bool:
    """A 400 saying a history tool-call turn lacks its reasoning (Moonshot with thinking on:
    "thinking is enabled but reasoning_content is missing in assistant tool call message")."""
    low = message.lower()
    return "reasoning" in low and ("missing" in low or "required" in low)


def _client_error(reason: str, msg: str, status: int, ra=None) -> Outcome:
    if names_missing_reasoning(msg):
        return Outcome("fail", MISSING_REASONING, message=msg, status=status)
    return Outcome("fail", reason, ra, message=msg, status=status)


def classify(status: int, body, headers=None) -> Outcome:
    """Classify one HTTP reply by its status, an error object in a 200 body, and its finish reason.

    ``body`` is the raw bytes/str (leading whitespace allowed) or parsed JSON; ``headers`` any
    mapping (only ``Retry-After`` is read). Pure and side-effect free.
    """
    data, parsed = parse_json(body)
    err = data.get("error") if isinstance(data, dict) else None
    msg = _error_message(err) if err else ""
    ra = None
    if headers is not None:
        ra = parse_retry_after(headers.get("retry-after") if hasattr(headers, "get") else None)
        if ra is None and hasattr(headers, "get"):
            ra = parse_retry_after(headers.get("Retry-After"))
    if ra is None and isinstance(err, dict) and isinstance(err.get("availability"), dict):
        ra = parse_retry_after(err["availability"].get("retry_after"))

    if 200 <= status < 300:
        if not parsed:
            return Outcome("retry", "invalid_body", ra, status=status, message="the body is not JSON")
        if isinstance(data, list):
            if not data or not isinstance(data[0], dict):
                return Outcome("retry", "empty_body", ra, status=status)
            data = data[0]
            err = data.get("error")
            msg = _error_message(err) if err else ""
        if err:
            code = err.get("code") if isinstance(err, dict) else None
            if isinstance(code, int) and code in (401, 402):
                sub = classify(code, {"error": err})
                return Outcome(sub.kind, sub.reason, ra or sub.retry_after, sub.cooldown, msg, status)
            if isinstance(code, int) and 400 <= code < 500 and code not in (408, 429):
                return _client_error(f"error_in_body_{code}", msg, status, ra)
            return Outcome("retry", "error_in_body", ra, message=msg, status=status)
        choices = data.get("choices")
        if choices is not None:  # OpenAI / OpenRouter shape
            if not choices or not isinstance(choices[0], dict):
                return Outcome("retry", "no_choices", ra, status=status)
            c0 = choices[0]
            fr = c0.get("finish_reason")
            if c0.get("error") or fr == "error":
                return Outcome("retry", "finish_error", ra, message=_error_message(c0.get("error")), status=status)
            if fr is None:
                return Outcome("retry", "no_finish_reason", ra, status=status)
            if fr == "content_filter":
                return Outcome("fail", "content_filter", status=status)
            return Outcome("ok", str(fr), status=status)
        meta = data.get("meta_info")
        if isinstance(meta, dict):  # SGLang native shape
            fr = meta.get("finish_reason")
            if fr is None:
                return Outcome("retry", "no_finish_reason", ra, status=status)
            kind = fr.get("type") if isinstance(fr, dict) else str(fr)
            if kind == "abort":
                sc = fr.get("status_code") if isinstance(fr, dict) else None
                amsg = str(fr.get("message", ""))[:500] if isinstance(fr, dict) else ""
                if isinstance(sc, int) and 400 <= sc < 500 and sc not in (408, 429):
                    return Outcome("fail", f"abort_{sc}", message=amsg, status=status)
                return Outcome("retry", "abort", ra, message=amsg, status=status)
            return Outcome("ok", str(kind), status=status)
        return Outcome("fail", "unrecognized_body", status=status)

    if status == 401:
        return Outcome("stop", "unauthorized", message=msg, status=status)
    if status == 402:
        meta = err.get("metadata") if isinstance(err, dict) else None
        source = str((meta or {}).get("limit_source", "")) if isinstance(meta, dict) else ""
        if "in_flight" in source:
            return Outcome("retry", "in_flight_budget", ra, True, msg, status)
        if "key_limit" in source:
            return Outcome("stop", "key_limit", message=msg, status=status)
        return Outcome("stop", "credits", message=msg, status=status)
    if status == 429:
        return Outcome("retry", "rate_limited", ra, True, msg, status)
    if status == 408:
        return Outcome("retry", "http_408", ra, message=msg, status=status)
    if status >= 500:  # 500, 502, 503, 504, 524, 529 ...
        return Outcome("retry", f"http_{status}", ra, message=msg, status=status)
    return _client_error(f"http_{status}", msg, status)


def classify_exception(exc: BaseException) -> Outcome:
    """Transport failures (no HTTP reply) are all retryable."""
    if isinstance(exc, asyncio.TimeoutError):
        return Outcome("retry", "attempt_timeout", message="the attempt deadline passed")
    if isinstance(exc, httpx.TimeoutException):
        return Outcome("retry", "timeout", message=type(exc).__name__)
    if isinstance(exc, httpx.RemoteProtocolError):
        return Outcome("retry", "disconnected", message=type(exc).__name__)
    if isinstance(exc, (httpx.ConnectError, ConnectionError)):
        return Outcome("retry", "connect_error", message=type(exc).__name__)
    return Outcome("retry", "transport_error", message=type(exc).__name__)
