"""OpenRouter's chat completions on the wire: text replies, billed per token, the key checked before a run."""

from __future__ import annotations

import json

from eagle3_assets.engines.http.classify import Outcome, classify, parse_json
from eagle3_assets.engines.http.client import Prices
from eagle3_assets.engines.http.samples import SampleRequest, SamplingSettings
from eagle3_assets.engines.http.tool_flags import tool_flags
from eagle3_assets.engines.http.wire import FINISH, Parsed, Prepared, base_row, key_id, now_iso, redactor, sample_seed
from eagle3_assets.target.tool_calls import reply_calls


def openrouter_messages(messages: list[dict]) -> list[dict]:
    """The history as OpenRouter takes it back: an assistant turn's reasoning in ``reasoning``
    (OpenRouter's field; it hands it to the provider in the provider's own, e.g. Moonshot's
    ``reasoning_content``), so a thinking model's tool-call turns are not refused for lacking it."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("reasoning_content"):
            m = {k: v for k, v in m.items() if k != "reasoning_content"} | {"reasoning": m["reasoning_content"]}
        out.append(m)
    return out


class OpenRouterBackend:
    """OpenRouter chat completions (non-streaming).

    ``api_key`` is only ever put in client headers; ``redact`` scrubs it from any text, and
    ``repr`` never shows it. ``provider`` is OpenRouter's routing object (``order``,
    ``allow_fallbacks``, ``require_parameters``, ``quantizations``...); ``reasoning`` the reasoning
    object (``{"effort": "high"}``, ``{"max_tokens": N}``, ``{"enabled": False}``). ``prices``
    (USD per token) feed only pre-run *estimates*; rows record the billed ``usage.cost``.
    A prompt with tools sends them, and routing then asks for ``require_parameters`` (unless the
    ``provider`` object says otherwise), so no provider that would drop ``tools`` serves it.
    """

    source = "openrouter"

    def __init__(self, api_key: str, model: str, *, provider: dict | None = None, reasoning: dict | None = None,
                 base_url: str = "https://openrouter.ai/api/v1", prices: Prices | None = None,
                 app_name: str | None = "eagle3-assets", app_url: str | None = None, extra_body: dict | None = None):
        if not api_key:
            raise ValueError("OpenRouterBackend needs an API key")
        self._api_key = api_key
        self.redact = redactor(api_key)
        self.model = model
        self.provider = provider
        self.reasoning = reasoning
        self.base_url = base_url.rstrip("/")
        self.base_urls = [self.base_url]
        self.prices = prices
        self.app_name, self.app_url = app_name, app_url
        self.extra_body = dict(extra_body or {})

    def __repr__(self) -> str:
        return f"OpenRouterBackend(model={self.model!r}, base_url={self.base_url!r}, api_key='***')"

    @property
    def key_id(self) -> str:
        """The key's fingerprint in the key-usage ledger (never the key)."""
        return key_id(self._api_key)

    def headers(self) -> dict:
        h = {"Authorization": f"Bearer {self._api_key}"}
        if self.app_name:
            h["X-Title"] = self.app_name
        if self.app_url:
            h["HTTP-Referer"] = self.app_url
        return h

    def prepare(self, req: SampleRequest, *, max_tokens: int, sampling: SamplingSettings) -> Prepared:
        payload = {"model": self.model, "messages": openrouter_messages(req.messages), "max_tokens": max_tokens,
                   "temperature": sampling.temperature, "top_p": sampling.top_p, "stream": False}
        if sampling.temperature > 0:
            payload["seed"] = sample_seed(sampling, req)
        if self.provider:
            payload["provider"] = self.provider
        if req.tools:
            payload["tools"] = req.tools
            payload["provider"] = {"require_parameters": True, **(self.provider or {})}
        if self.reasoning is not None:
            payload["reasoning"] = self.reasoning
        payload.update(self.extra_body)
        return Prepared(req, None, payload, json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode())

    def request(self, prepared: Prepared, attempt: int) -> tuple[str, bytes]:
        return "/chat/completions", prepared.body

    def parse(self, prepared: Prepared, status: int, headers, body: bytes, *, latency_s: float, attempts: int,
              base_url: str) -> Parsed:
        data, ok = parse_json(body)
        outcome = classify(status, data if ok else body, headers)
        usage = data.get("usage") if isinstance(data, dict) else None
        cost = usage.get("cost") if isinstance(usage, dict) else None
        if not outcome.ok:
            return Parsed(Outcome(outcome.kind, outcome.reason, outcome.retry_after, outcome.cooldown,
                                  self.redact(outcome.message), outcome.status), cost_usd=cost)
        c0 = data["choices"][0]
        msg = c0.get("message") or {}
        flags = []
        if not isinstance(usage, dict):
            usage = {}
            flags.append("usage_missing")
        if cost is None:
            flags.append("cost_missing")
        details = usage.get("completion_tokens_details") or {}
        fr = c0.get("finish_reason")
        finish = FINISH.get(fr)
        if finish is None:
            finish = "error"
            flags.append(f"unknown_finish_reason:{fr}")
        reasoning = msg.get("reasoning")
        if reasoning is None and msg.get("reasoning_details"):
            reasoning = "".join(d.get("text") or d.get("summary") or "" for d in msg["reasoning_details"]
                                if isinstance(d, dict)) or None
        calls = reply_calls(msg.get("tool_calls"))
        flags += tool_flags(prepared.req, calls)
        row = base_row(prepared.req, self.source)
        row.update({
            "model": data.get("model") or self.model, "provider": data.get("provider"),
            "prompt_ids": None, "output_ids": None, "text": msg.get("content"), "reasoning": reasoning,
            "tool_calls": calls, "finish_reason": finish, "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),  # reasoning tokens included
            "cost_usd": cost, "latency_s": round(latency_s, 4), "attempts": attempts, "created_at": now_iso(),
            "reasoning_tokens": details.get("reasoning_tokens") or 0, "native_finish_reason": c0.get("native_finish_reason"),
            "generation_id": data.get("id"),
        })
        row["flags"] = list(flags)
        return Parsed(outcome, row, cost, tuple(flags))

    async def _key(self, client) -> tuple[int, dict | None]:
        r = await client.get(self.base_url + "/key", timeout=30.0)
        data, ok = parse_json(r.content)
        return r.status_code, (data.get("data") if ok and isinstance(data, dict) else None)

    async def preflight(self, client, base_urls) -> tuple[dict, Outcome | None]:
        """``GET /key``: a bad key stops the run before any generation; records usage for reconciliation."""
        info: dict = {"model": self.model, "provider": self.provider, "reasoning": self.reasoning}
        try:
            status, data = await self._key(client)
        except Exception as e:  # noqa: BLE001 - the key check is advisory; generation will tell
            info["key_check"] = self.redact(f"unavailable: {type(e).__name__}")
            return info, None
        if status in (401, 402):
            out = classify(status, {"error": {"code": status, "message": "key check failed"}})
            return info, Outcome(out.kind, out.reason, message=f"GET /key answered {status}", status=status)
        if status == 200 and data:
            info.update(key_usage_before=data.get("usage"), key_limit=data.get("limit"),
                        key_limit_remaining=data.get("limit_remaining"))
            self._usage_before = data.get("usage")
        return info, None

    async def postflight(self, client, base_urls) -> dict:
        status, data = await self._key(client)
        if status != 200 or not data or data.get("usage") is None:
            return {}
        out = {"key_usage_after": data.get("usage")}
        before = getattr(self, "_usage_before", None)
        if before is not None:
            out["key_usage_delta"] = data["usage"] - before  # what the server billed during the run
        return out


def openrouter_backend(settings, model: str) -> OpenRouterBackend:
    """The backend for ``model`` (the target's served name, its OpenRouter slug) with the key, routing,
    reasoning and listed prices ``settings`` (the ``openrouter`` resource) holds."""
    key = settings.resolved_api_key()
    if not key:
        raise ValueError(f"no OpenRouter API key: set {settings.api_key_env} where the code location runs, "
                         "then reload it")
    prices = None
    if settings.usd_per_million_prompt or settings.usd_per_million_completion:
        prices = Prices.per_million(settings.usd_per_million_prompt, settings.usd_per_million_completion)
    return OpenRouterBackend(key, model, provider=settings.provider or None,
                             reasoning=settings.reasoning or None, base_url=settings.base_url, prices=prices)
