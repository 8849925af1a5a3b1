"""The OpenRouter loopback: chat completions, key and models endpoints, billing and the per-request
ledger, over the shared app base (``apps.py``)."""

from __future__ import annotations

import asyncio
import math
import secrets
import time

from .apps import STATUS_OF, LoopbackApp, error_reply, messages_key
from .http import Reply, Request
from .ledger import Ledger
from .tool_replies import with_tool_calls


class OpenRouterApp(LoopbackApp):
    """OpenRouter's ``POST /api/v1/chat/completions`` (non-streaming), ``/api/v1/key``, ``/api/v1/models``.

    With ``api_key`` set, any other bearer token gets a 401 whose message *echoes the presented
    key* - on purpose, so tests can prove the client redacts it. ``reasoning`` requests are
    simulated by labelling the first third of the generated tokens as reasoning (counted in
    ``completion_tokens`` and ``completion_tokens_details.reasoning_tokens``). A request with
    ``tools`` to a user turn is answered with structured ``tool_calls`` and ``finish_reason``
    ``tool_calls`` (see ``tool_replies``), billed by its tokens; with ``drops_tools`` the provider
    ignores ``tools`` unless routing asks for ``require_parameters``, as a real pool with one
    provider that drops them would.
    """

    name = "openrouter"
    generation_paths = ("/api/v1/chat/completions",)

    def __init__(self, generator, *, api_key: str | None = None, provider_name: str = "Loopback",
                 prompt_price: float = 0.6e-6, completion_price: float = 2.5e-6,
                 credits_usd: float | None = None, key_usage_start_usd: float = 0.0, drops_tools: bool = False, **kw):
        """``key_usage_start_usd``: what the key had spent before (``/key`` usage starts there)."""
        super().__init__(generator, **kw)
        self.ledger = Ledger()
        self.key_usage_start_usd = key_usage_start_usd
        self.api_key = api_key
        self.drops_tools = drops_tools
        self.provider_name = provider_name
        self.prompt_price, self.completion_price = prompt_price, completion_price
        self.credits_usd = credits_usd
        self.served_model = "loopback/" + generator.name
        self._gen_n = 0

    def reset(self) -> None:
        super().reset()
        self.ledger.reset()

    def stats(self, gate: int | None = None) -> dict:
        s = super().stats(gate)
        s["ledger"] = self.ledger.totals()
        s["ledger_entries"] = self.ledger.rows()
        return s

    def _auth(self, req: Request) -> Reply | None:
        if self.api_key is None:
            return None
        auth = req.headers.get("authorization", "")
        presented = auth[7:] if auth.lower().startswith("bearer ") else auth
        if presented != self.api_key:
            return Reply.json({"error": {"code": 401, "message": f"Invalid API key: {presented}"}}, 401)
        return None

    async def route(self, req: Request) -> Reply:
        if req.path.startswith("/api/v1/"):
            denied = self._auth(req)
            if denied is not None:
                if req.path == "/api/v1/chat/completions":
                    self.requests += 1
                return denied
        if req.path == "/api/v1/chat/completions" and req.method == "POST":
            return await self.complete(req)
        if req.path in ("/api/v1/key", "/api/v1/auth/key"):
            usage = self.key_usage_start_usd + math.fsum(self.billed)
            return Reply.json({"data": {
                "label": "sk-or-v1-loo...back", "limit": self.credits_usd, "usage": usage,
                "limit_remaining": None if self.credits_usd is None else self.credits_usd - usage,
                "is_free_tier": False, "usage_daily": usage,
            }})
        if req.path == "/api/v1/models":
            return Reply.json({"data": [{
                "id": self.served_model, "name": f"Loopback {self.gen.name}", "context_length": 8192,
                "pricing": {"prompt": f"{self.prompt_price:.10f}", "completion": f"{self.completion_price:.10f}",
                            "request": "0"},
                "supported_parameters": ["max_tokens", "temperature", "top_p", "seed", "reasoning"],
                "reasoning": {"supported_efforts": ["low", "medium", "high"], "default_enabled": False},
            }]})
        return await super().route(req)

    async def complete(self, req: Request) -> Reply:
        self.requests += 1
        if self.on_request is not None:
            self.on_request(self.requests)
        try:
            body = req.json()
        except ValueError:
            return Reply.json({"error": {"code": 400, "message": "invalid JSON body"}}, 400)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return Reply.json({"error": {"code": 400, "message": "messages must be a non-empty array"}}, 400)
        group = self.observer.enter(body)
        entry = self.ledger.open(messages_key(messages))
        try:
            reply = await self._complete(body, messages)
        finally:
            self.observer.leave(group)
        self.ledger.follow(entry, reply)
        return reply

    async def _complete(self, body: dict, messages: list) -> Reply:
        if self.credits_usd is not None and math.fsum(self.billed) >= self.credits_usd:
            return error_reply("402credits", self.faults.retry_after_s)
        fault = self.faults.next()
        if fault == "drop":
            return Reply(drop=True)
        if fault in STATUS_OF:
            return error_reply(fault, self.faults.retry_after_s)
        await self.simulated_latency(fault)
        if fault == "error200":
            return self.with_fault_shape("heartbeat", Reply.json({"error": {
                "code": 502, "message": "Provider returned error",
                "metadata": {"error_type": "provider_unavailable", "provider_name": self.provider_name}}}))
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 256)
        temperature = float(body.get("temperature", 1.0))
        required = (body.get("provider") or {}).get("require_parameters") is True
        tools = body.get("tools") if not self.drops_tools or required else None
        prompt_ids = self.gen.render(messages, tools) if tools else self.gen.render(messages)
        self._gen_n += 1
        gen_id = f"gen-{self._gen_n}-{secrets.token_hex(6)}"
        model = body.get("model") or self.served_model
        if fault == "finish_error":  # zero-completion insurance: a failed generation is not billed
            return Reply.json({
                "id": gen_id, "provider": self.provider_name, "model": model, "object": "chat.completion",
                "created": int(time.time()),
                "choices": [{"index": 0, "finish_reason": "error", "native_finish_reason": "error",
                             "message": {"role": "assistant", "content": "partial", "reasoning": None},
                             "error": {"code": 502, "message": "upstream stream ended unexpectedly"}}],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": 0, "total_tokens": len(prompt_ids),
                          "cost": 0, "completion_tokens_details": {"reasoning_tokens": 0}},
            })
        out = await self.gen.generate(prompt_ids, max_new_tokens=max_tokens, temperature=temperature,
                                      top_p=float(body.get("top_p", 1.0)), seed=int(body.get("seed", 0) or 0))
        if self.latency_per_token_s:
            await asyncio.sleep(len(out.output_ids) * self.latency_per_token_s)
        out, call = with_tool_calls(self.gen, prompt_ids, out) if tools else (out, None)
        reasoning_cfg = body.get("reasoning")
        thinking = (bool(reasoning_cfg) and reasoning_cfg.get("enabled", True) is not False
                    and reasoning_cfg.get("effort") != "none")
        n = len(out.output_ids)
        r = n // 3 if thinking else 0
        reasoning_text = self.gen.decode(out.output_ids[:r]) if r else None
        content = self.gen.decode(out.output_ids[r:])
        finish, native_finish = out.finish_reason, "eos" if out.finish_reason == "stop" else "max_tokens"
        if call is not None:  # the reasoning parser's and the tool parser's reading of the ids
            r, reasoning_text = (call.reasoning_tokens, call.reasoning) if thinking else (0, None)
            content, finish, native_finish = call.content, "tool_calls", "tool_calls"
        cost = len(prompt_ids) * self.prompt_price + n * self.completion_price
        self.billed.append(cost)
        self.ledger.bill(cost, gen_id)
        self.completion_tokens_billed += n
        key = messages_key(messages)
        self.generated[key] += 1
        if fault == "billed_drop":  # generated and billed, then lost on the way
            return Reply(drop=True)
        reply = Reply.json({
            "id": gen_id, "provider": self.provider_name, "model": model, "object": "chat.completion",
            "created": int(time.time()), "system_fingerprint": None,
            "choices": [{"index": 0, "logprobs": None, "finish_reason": finish, "native_finish_reason": native_finish,
                         "message": {"role": "assistant", "content": content, "refusal": None,
                                     "reasoning": reasoning_text,
                                     **({"tool_calls": call.tool_calls} if call is not None else {})}}],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n,
                      "cost": cost, "is_byok": False, "prompt_tokens_details": {"cached_tokens": 0},
                      "completion_tokens_details": {"reasoning_tokens": r},
                      "cost_details": {"upstream_inference_cost": None}},
        })
        reply.on_sent = lambda: self.observer.delivered(key)
        return self.with_fault_shape(fault, reply)
