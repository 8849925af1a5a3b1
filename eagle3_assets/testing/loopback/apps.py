"""The two loopback protocols: SGLang's native ``/generate`` and OpenRouter's chat completions.

Both keep statistics a test can read (``GET /_loopback/stats`` or ``app.stats()``): requests and
faults, what was generated per sample, server-side concurrency (``?gate=N`` adds the share of time
with 95% of N or more generation requests in progress), and for OpenRouter the dollars billed (the
exact float sum of every ``usage.cost`` sent, so a client can reconcile to the cent) and the
per-request ledger (:mod:`.ledger`: billed, delivered, billed but undelivered).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import secrets
import time
from collections import Counter

from .faults import FaultPlan
from .http import HTTPServer, Reply, Request
from .ledger import Ledger
from .observe import Observer
from .tool_replies import with_tool_calls

STATUS_OF = {"429": 429, "408": 408, "500": 500, "502": 502, "503": 503, "524": 524, "529": 529,
             "402inflight": 402, "402credits": 402, "402keylimit": 402, "401": 401, "400": 400}
MESSAGES = {
    429: "Rate limit exceeded: loopback is rate limited upstream. Please retry shortly.",
    408: "Request timed out", 500: "Internal Server Error", 502: "Provider returned error",
    503: "Provider overloaded", 524: "A timeout occurred", 529: "Provider is overloaded", 401: "User not found.",
    400: "This endpoint's maximum context length is 8192 tokens. (context_length_exceeded)",
}
ERROR_TYPES = {429: "rate_limit_exceeded", 408: "timeout", 500: "server", 502: "provider_unavailable",
               503: "provider_overloaded", 524: "timeout", 529: "provider_overloaded"}
LIMIT_SOURCES = {"402inflight": "openrouter_in_flight_budget", "402credits": "openrouter_credits",
                 "402keylimit": "openrouter_key_limit"}


def messages_key(messages) -> str:
    """A stable key of one conversation (what the OpenRouter loopback records per generation)."""
    return hashlib.sha256(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def error_reply(fault: str, retry_after_s: float) -> Reply:
    """The documented error body and headers of a status fault."""
    status = STATUS_OF[fault]
    err: dict = {"code": status, "message": MESSAGES.get(status, "error")}
    headers = {}
    if fault in LIMIT_SOURCES:
        src = LIMIT_SOURCES[fault]
        err["message"] = {
            "openrouter_in_flight_budget": "In-flight spending budget exhausted; retry after in-flight requests finish.",
            "openrouter_credits": "Insufficient credits. Add more using https://openrouter.ai/credits",
            "openrouter_key_limit": "Key limit exceeded. Raise the limit of this key.",
        }[src]
        err["metadata"] = {"limit_source": src}
        if fault == "402inflight":
            headers["Retry-After"] = f"{retry_after_s:g}"
    elif status in ERROR_TYPES:
        err["metadata"] = {"error_type": ERROR_TYPES[status], "provider_name": "Loopback"}
    if status == 400:
        err["metadata"] = {"error_type": "context_length_exceeded"}
    if status in (429, 503):
        headers["Retry-After"] = f"{retry_after_s:g}"
    return Reply.json({"error": err}, status, headers)


class LoopbackApp:
    name = "loopback"
    generation_paths: tuple[str, ...] = ()  # what the in-flight meter counts

    def __init__(self, generator, *, faults: FaultPlan | None = None, latency_s: float = 0.0,
                 latency_jitter_s: float = 0.0, latency_exponential: bool = False, latency_per_token_s: float = 0.0,
                 group_of=None, seed: int = 0):
        """Latency: ``latency_s`` (the mean of an exponential draw with ``latency_exponential``) plus
        uniform(0, ``latency_jitter_s``) before generating, plus ``latency_per_token_s`` per generated
        token after it (long replies take longer, as with a real decoder). ``group_of(body)`` names
        a request's group for the concurrency-by-group figures; ``on_request(n)``, when set, is
        called with the running count of generation requests (tests use it to kill a client)."""
        self.gen = generator
        self.faults = faults or FaultPlan()
        self.latency_s, self.latency_jitter_s = latency_s, latency_jitter_s
        self.latency_exponential, self.latency_per_token_s = latency_exponential, latency_per_token_s
        self.observer = Observer(group_of)
        self.on_request = None
        self._rng = random.Random(seed + 1)
        self.server: HTTPServer | None = None
        self.requests = 0
        self.by_status: Counter = Counter()
        self.generated: Counter = Counter()  # generations per sample key, successful replies only
        self.billed: list[float] = []
        self.completion_tokens_billed = 0
        self.started = time.time()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> HTTPServer:
        self.server = await HTTPServer(self.handle, host, port, counted=self.generation_paths.__contains__).start()
        return self.server

    async def aclose(self) -> None:
        if self.server is not None:
            await self.server.close()
        await self.gen.aclose()

    async def handle(self, req: Request) -> Reply:
        try:
            reply = await self.route(req)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a loopback bug answers 500 rather than hanging
            reply = Reply.json({"error": {"code": 500, "message": f"loopback error: {type(e).__name__}: {e}"}}, 500)
        self.by_status[reply.status if not reply.drop else "dropped"] += 1
        return reply

    async def route(self, req: Request) -> Reply:
        if req.path == "/_loopback/stats":
            gate = dict(kv.partition("=")[::2] for kv in req.query.split("&") if kv).get("gate")
            return Reply.json(self.stats(gate=int(gate) if gate else None))
        if req.path == "/_loopback/reset":
            self.reset()
            return Reply.json({"ok": True})
        if req.path == "/_loopback/config" and req.method == "POST":
            cfg = req.json() or {}
            for k in ("latency_s", "latency_jitter_s"):
                if k in cfg:
                    setattr(self, k, float(cfg[k]))
            return Reply.json({"latency_s": self.latency_s, "latency_jitter_s": self.latency_jitter_s})
        return Reply.json({"detail": "Not Found"}, 404)

    async def simulated_latency(self, fault: str) -> None:
        base = self._rng.expovariate(1.0 / self.latency_s) if self.latency_exponential and self.latency_s > 0 \
            else self.latency_s
        delay = base + (self._rng.uniform(0, self.latency_jitter_s) if self.latency_jitter_s else 0.0)
        if fault == "slow":
            delay += self.faults.slow_s
        if delay > 0:
            await asyncio.sleep(delay)

    def with_fault_shape(self, fault: str, reply: Reply) -> Reply:
        if fault == "heartbeat":
            reply.heartbeats = self.faults.heartbeats
            reply.heartbeat_interval_s = self.faults.heartbeat_interval_s
        return reply

    def reset(self) -> None:
        self.requests = 0
        self.by_status.clear()
        self.generated.clear()
        self.faults.injected.clear()
        self.observer.reset()
        if self.server is not None:
            self.server.meter.reset()

    def full_share(self, gate: int, level: float = 0.95) -> float:
        """Share of the time from the first generation request to the last reply written with at
        least ``level`` x ``gate`` of them in progress, as this server saw it (drain included)."""
        return self.server.meter.share_at_least(level * gate) if self.server else 0.0

    def stats(self, gate: int | None = None) -> dict:
        meter = self.server.meter if self.server else None
        extra = {} if gate is None else {"gate": gate, "full_gate_share": self.full_share(gate)}
        return {**extra,
            "app": self.name,
            "synthetic": bool(getattr(self.gen, "synthetic", False)),
            "requests": self.requests,
            "by_status": {str(k): v for k, v in self.by_status.items()},
            "faults": dict(self.faults.injected),
            "generated": dict(self.generated),
            "generations": sum(self.generated.values()),
            "billed_usd": math.fsum(self.billed),
            "billed_replies": len(self.billed),
            "completion_tokens_billed": self.completion_tokens_billed,
            "concurrency_peak": meter.peak if meter else 0,
            "concurrency_mean": meter.mean if meter else 0.0,
            "concurrency_now": meter.active if meter else 0,
            "concurrency_area": meter.area if meter else 0.0,  # mean over [t1, t2] = d(area) / d(time)
            "time": time.monotonic(),
            "connections_open": self.server.connections if self.server else 0,
            **self.observer.stats(),
        }


class SGLangApp(LoopbackApp):
    """SGLang's native API: ``POST /generate`` with ``input_ids``, ``/health_generate``, ``/model_info``.

    ``prefix_bug`` (a probability) reproduces the known SGLang bug where ``output_ids`` begin with
    up to 5 prompt tokens while ``meta_info.completion_tokens`` is right.
    """

    name = "sglang"
    generation_paths = ("/generate",)

    def __init__(self, generator, *, prefix_bug: float = 0.0, healthy: bool = True, **kw):
        super().__init__(generator, **kw)
        self.prefix_bug = prefix_bug
        self.healthy = healthy
        self.prefix_bug_injected = 0

    async def route(self, req: Request) -> Reply:
        if req.path in ("/health", "/health_generate"):
            return Reply(200 if self.healthy else 503)
        if req.path in ("/model_info", "/get_model_info"):
            return Reply.json({
                "model_path": self.gen.name, "tokenizer_path": self.gen.name, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": "default",
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": "synthetic" if self.gen.synthetic else "llama", "architectures": ["LlamaForCausalLM"],
            })
        if req.path in ("/server_info", "/get_server_info"):
            return Reply.json({"version": "loopback", "model_path": self.gen.name, "loopback_synthetic": self.gen.synthetic})
        if req.path == "/generate" and req.method in ("POST", "PUT"):
            return await self.generate(req)
        return await super().route(req)

    async def generate(self, req: Request) -> Reply:
        self.requests += 1
        try:
            body = req.json()
        except ValueError:
            return Reply.json({"error": {"message": "invalid JSON body"}}, 400)
        ids = body.get("input_ids")
        if ids is None:
            return Reply.json({"error": {"message": "Either text, input_ids or input_embeds should be provided."}}, 400)
        if not isinstance(ids, list) or not ids:
            return Reply.json({"error": {"message": "input_ids cannot be empty."}}, 400)
        if not isinstance(ids[0], int):
            return Reply.json({"error": {"message": "the loopback serves single requests only, not batches"}}, 400)
        if max(ids) >= self.gen.vocab_size:
            msg = f"The input_ids {max(ids)} contains values greater than the vocab size ({self.gen.vocab_size})."
            return Reply.json({"error": {"message": msg}}, 400)
        sp = body.get("sampling_params") or {}
        max_new = int(sp.get("max_new_tokens", 128))
        temperature = float(sp.get("temperature", 1.0))
        top_p = float(sp.get("top_p", 1.0))
        if not 0 < top_p <= 1:
            return Reply.json({"error": {"message": f"top_p must be in (0, 1], got {top_p}."}}, 400)
        rid = body.get("rid") or secrets.token_hex(8)
        fault = self.faults.next()
        if fault == "drop":
            return Reply(drop=True)
        if fault in STATUS_OF:
            return error_reply(fault, self.faults.retry_after_s)
        if fault == "error200":
            return Reply.json({"error": {"message": "scheduler failed", "code": 500}}, 200)
        await self.simulated_latency(fault)
        t0 = time.monotonic()
        if fault == "finish_error":
            return Reply.json({"text": "", "output_ids": [], "meta_info": {
                "id": rid, "finish_reason": {"type": "abort", "message": "request aborted by the scheduler",
                                             "status_code": 500, "err_type": None},
                "prompt_tokens": len(ids), "completion_tokens": 0, "cached_tokens": 0}})
        out = await self.gen.generate(ids, max_new_tokens=max_new, temperature=temperature if temperature >= 1e-6 else 0.0,
                                      top_p=top_p, seed=int(sp.get("sampling_seed", 0) or 0))
        out, _ = with_tool_calls(self.gen, ids, out)  # tools declared in the ids: a tool-using model calls them
        output_ids = list(out.output_ids)
        if self.prefix_bug and self._rng.random() < self.prefix_bug:
            k = min(5, len(ids))
            output_ids = ids[-k:] + output_ids
            self.prefix_bug_injected += 1
        if out.finish_reason == "stop":
            finish = {"type": "stop", "matched": out.output_ids[-1]}
        else:
            finish = {"type": "length", "length": max_new}
        self.generated[str(rid).rsplit("-", 1)[0]] += 1
        self.completion_tokens_billed += len(out.output_ids)
        reply = Reply.json({"text": self.text_of(out, sp), "output_ids": output_ids, "meta_info": {
            "id": rid, "finish_reason": finish, "prompt_tokens": len(ids),
            "completion_tokens": len(out.output_ids), "cached_tokens": 0,
            "e2e_latency": round(time.monotonic() - t0, 6),
        }})
        return self.with_fault_shape(fault, reply)

    def text_of(self, out, sp: dict) -> str:
        """``text`` as SGLang's detokenizer makes it from the ids and the request's text options
        (defaults: skip special tokens, spaces between added tokens, stop token trimmed)."""
        decode = getattr(self.gen, "decode_with", None)
        if decode is None:
            return out.text
        ids = list(out.output_ids)
        if out.finish_reason == "stop" and not sp.get("no_stop_trim", False):
            ids = ids[:-1]
        return decode(ids, skip_special_tokens=bool(sp.get("skip_special_tokens", True)),
                      spaces_between_special_tokens=bool(sp.get("spaces_between_special_tokens", True)))

    def stats(self, gate: int | None = None) -> dict:
        s = super().stats(gate)
        s["prefix_bug_injected"] = self.prefix_bug_injected
        return s


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
