"""The two HTTP backends of :mod:`http_engine`: SGLang's native ``/generate`` and OpenRouter.

A backend turns a :class:`SampleRequest` into an HTTP request (``prepare`` once, ``request``
per attempt) and a reply into an :class:`Outcome` plus, when it is kept, a response row with
every key of ``RESPONSE_FIELDS``. It also knows its pre-run checks (``preflight``), what to put
in client headers, and how to ``redact`` its secret from any text.

Rows also carry ``reasoning_tokens``, ``native_finish_reason`` and ``generation_id``; the
current row contract (``RESPONSE_FIELDS``) does not persist them, the engine's report sums them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from eagle3_assets.generation.classify import Outcome, classify, parse_json
from eagle3_assets.generation.http_config import Prices
from eagle3_assets.generation.http_report import BackendUnavailable
from eagle3_assets.generation.response_store import now_iso
from eagle3_assets.generation.samples import SampleRequest, SamplingSettings
from eagle3_assets.generation.tool_calls import tool_flags
from eagle3_assets.target.tool_calls import reply_calls

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


def _base_row(req: SampleRequest, source: str) -> dict:
    return {"sample_id": req.sample_id, "dataset": req.dataset, "prompt_id": req.prompt_id,
            "sample_index": req.sample_index, "source": source}


def _redactor(*secrets: str | None) -> Callable[[str], str]:
    secrets = tuple(s for s in secrets if s)

    def redact(text) -> str:
        text = "" if text is None else str(text)
        for s in secrets:
            if s in text:
                text = text.replace(s, "***")
        return text

    return redact


class SGLangBackend:
    """SGLang's native API: ``POST /generate`` with locally rendered ``input_ids`` and an explicit ``rid``.

    ``base_urls``: one or more servers (data parallelism; the engine spreads client shards over
    them). ``render_prompt(messages) -> ids`` renders the chat template locally (e.g.
    ``TargetTokenizer.render_prompt``). ``model`` names the rows' model (default: ``/model_info``'s
    ``model_path``). ``sampling_params`` are merged into every request's sampling params (e.g.
    ``{"stop_token_ids": [...]}``); ``extra`` into the request body. ``api_key`` for servers
    started with ``--api-key``. ``text_options``: SGLang's ``skip_special_tokens``,
    ``spaces_between_special_tokens`` and ``no_stop_trim``, sent in every request's sampling
    params (default: the text closest to the ids, see ``TEXT_OPTIONS``) and recorded in each
    row's flags when they differ from that default. ``parse_tool_calls(output_ids)`` reads the
    calls a reply makes from its ids (the target's own format; e.g. ``TargetTokenizer.parse_tool_calls``),
    kept structured on the row: ``/generate`` parses nothing itself.
    """

    TEXT_OPTIONS = {"skip_special_tokens": False, "spaces_between_special_tokens": False, "no_stop_trim": False}

    source = "sglang"

    def __init__(self, base_urls, render_prompt: Callable[[list], list[int]], *, model: str | None = None,
                 sampling_params: dict | None = None, extra: dict | None = None, api_key: str | None = None,
                 health_check: bool = True, repair_prefix_bug: bool = False, text_options: dict | None = None,
                 parse_tool_calls: Callable[[list[int]], list[dict] | None] | None = None):
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("SGLangBackend needs at least one base URL")
        self.base_urls = [u.rstrip("/") for u in urls]
        self.render_prompt = render_prompt
        self.model = model
        self.sampling_params = dict(sampling_params or {})
        self.extra = dict(extra or {})
        self._api_key = api_key
        self.redact = _redactor(api_key)
        self.health_check = health_check
        self.repair_prefix_bug = repair_prefix_bug
        self.parse_tool_calls = parse_tool_calls
        self.server_info: dict = {}
        unknown = set(text_options or {}) - set(self.TEXT_OPTIONS)
        if unknown:
            raise ValueError(f"unknown SGLang text options {sorted(unknown)}; known: {sorted(self.TEXT_OPTIONS)}")
        self.text_options = {**self.TEXT_OPTIONS, **(text_options or {})}
        self._text_flags = tuple(f"text_option:{k}={str(v).lower()}" for k, v in self.text_options.items()
                                 if v != self.TEXT_OPTIONS[k])

    def __repr__(self) -> str:
        return f"SGLangBackend(base_urls={self.base_urls!r}, model={self.model!r})"

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}

    def prepare(self, req: SampleRequest, *, max_tokens: int, sampling: SamplingSettings) -> Prepared:
        ids = req.render(self.render_prompt)  # tools rendered into the ids by the target's template
        sp = {"max_new_tokens": max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p}
        if sampling.temperature > 0:
            sp["sampling_seed"] = sample_seed(sampling, req)
        sp.update(self.text_options)
        sp.update(self.sampling_params)
        payload = {"input_ids": ids, "sampling_params": sp, "stream": False, **self.extra}
        return Prepared(req, ids, payload)

    def request(self, prepared: Prepared, attempt: int) -> tuple[str, bytes]:
        # a fresh rid per attempt: a retry must not collide with a timed-out attempt still running
        body = dict(prepared.payload, rid=f"{prepared.req.sample_id}-{attempt}")
        return "/generate", json.dumps(body, separators=(",", ":")).encode()

    def parse(self, prepared: Prepared, status: int, headers, body: bytes, *, latency_s: float, attempts: int,
              base_url: str) -> Parsed:
        data, ok = parse_json(body)
        outcome = classify(status, data if ok else body, headers)
        if not outcome.ok:
            return Parsed(outcome)
        if isinstance(data, list):
            data = data[0]
        meta = data["meta_info"]
        flags = list(self._text_flags)
        rid = f"{prepared.req.sample_id}-{attempts}"
        if meta.get("id") not in (None, rid):
            return Parsed(Outcome("fail", "rid_mismatch", message=f"asked for {rid}, got {meta.get('id')}", status=status))
        output_ids = list(data.get("output_ids") or [])
        ct = meta.get("completion_tokens")
        if ct is None:
            ct = len(output_ids)
            flags.append("completion_tokens_missing")
        if len(output_ids) != ct:
            extra = len(output_ids) - ct
            prompt = prepared.prompt_ids
            if extra > 0 and self.repair_prefix_bug and output_ids[:extra] == prompt[len(prompt) - extra:]:
                output_ids = output_ids[extra:]  # sgl-project/sglang#10896: prompt tail leaked into output_ids
                flags.append("prefix_repaired")
            else:
                return Parsed(Outcome("fail", "output_ids_mismatch",
                                      message=f"{len(output_ids)} output_ids but completion_tokens={ct}", status=status))
        if meta.get("prompt_tokens") is not None and meta["prompt_tokens"] != len(prepared.prompt_ids):
            flags.append("prompt_tokens_mismatch")
        fr = meta.get("finish_reason")
        kind = fr.get("type") if isinstance(fr, dict) else str(fr)
        finish = FINISH.get(kind, "error")
        calls = self.parse_tool_calls(output_ids) if self.parse_tool_calls else None
        flags += tool_flags(prepared.req, calls)
        row = _base_row(prepared.req, self.source)
        row.update({
            "model": self.model or self.server_info.get("model_path") or "sglang", "provider": base_url,
            "prompt_ids": prepared.prompt_ids, "output_ids": output_ids, "text": data.get("text"),
            "reasoning": None, "tool_calls": calls, "finish_reason": finish,
            "prompt_tokens": meta.get("prompt_tokens", len(prepared.prompt_ids)),
            "completion_tokens": ct, "cost_usd": 0.0, "latency_s": round(latency_s, 4), "attempts": attempts,
            "created_at": now_iso(), "reasoning_tokens": meta.get("reasoning_tokens") or 0,
            "native_finish_reason": json.dumps(fr) if isinstance(fr, dict) else fr, "generation_id": meta.get("id"),
        })
        row["flags"] = list(flags)
        return Parsed(outcome, row, 0.0, tuple(flags))

    async def preflight(self, client, base_urls) -> tuple[dict, Outcome | None]:
        """``/health_generate`` on every server (raises BackendUnavailable), then ``/model_info``."""
        info: dict = {"base_urls": list(self.base_urls)}
        for url in self.base_urls:
            if self.health_check:
                try:
                    r = await client.get(url + "/health_generate", timeout=60.0)
                except Exception as e:  # noqa: BLE001
                    raise BackendUnavailable(self.redact(f"{url}/health_generate: {type(e).__name__}: {e}")) from None
                if r.status_code == 401:
                    return info, Outcome("stop", "unauthorized", message=self.redact(r.text[:300]), status=401)
                if r.status_code != 200:
                    raise BackendUnavailable(f"{url}/health_generate answered {r.status_code}")
            for path in ("/model_info", "/get_model_info"):
                try:
                    r = await client.get(url + path, timeout=30.0)
                except Exception:  # noqa: BLE001 - model info is informative only
                    break
                if r.status_code == 200:
                    mi = r.json()
                    if self.server_info and mi.get("model_path") != self.server_info.get("model_path"):
                        raise BackendUnavailable(
                            f"{url} serves {mi.get('model_path')!r}, another server {self.server_info.get('model_path')!r}")
                    self.server_info = mi
                    break
        info["model_info"] = self.server_info
        return info, None

    async def postflight(self, client, base_urls) -> dict:
        return {}


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
        self.redact = _redactor(api_key)
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
        from eagle3_assets.generation.key_ledger import key_id

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
        row = _base_row(prepared.req, self.source)
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
