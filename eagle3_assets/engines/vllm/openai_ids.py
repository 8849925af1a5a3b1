"""Generation through any OpenAI-compatible server that returns token ids (vLLM's ``return_token_ids``).

Text alone is not token-exact: re-tokenizing a reply loses the splits the model actually emitted
(vLLM serving SmolLM2: "\\n\\n" as one token, which the tokenizer never produces). vLLM (0.10.2 and
later) returns the ids when the request says ``"return_token_ids": true``: ``prompt_token_ids``
(the prompt as the server rendered it) at the top level and ``choices[0].token_ids`` (the
completion, the stop token included when it stopped on one, as SGLang's ``output_ids``). Rows keep
both, so ``token_ids`` builds the training sequence from the server's own ids and re-tokenizes the
text only to measure the drift (calibration).

Two request shapes:
- ``endpoint="chat"``: ``/v1/chat/completions`` with the messages; the server renders the chat
  template. When ``render_prompt`` is given, the server's prompt ids are compared with the local
  rendering and a row whose prompt differs is flagged ``prompt_differs_from_local`` (the server's
  ids are kept: they are what the completion was conditioned on).
- ``endpoint="completions"``: ``/v1/completions`` with the locally rendered prompt *ids*, so the
  prompt is exact by construction (``render_prompt`` required).

A server that ignores ``return_token_ids`` (no ids in the reply) fails the sample with
``no_token_ids`` instead of silently writing text-only rows: pick the ``openrouter`` backend for
text-only servers.

Tools: the chat endpoint sends the prompt's ``tools`` (vLLM renders them with the target's own
template and parses the reply's calls with ``--tool-call-parser``; ``message.tool_calls`` is kept
on the row, the ids stay the model's own); the completions endpoint has them in its rendered ids.
``stop_token_ids`` (the target's end of turn) is sent with every request: a target whose
``eos_token_id`` is not its end of turn (Kimi-K2.5) would otherwise decode past the turn.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from eagle3_assets.engines.http.classify import Outcome, classify, parse_json
from eagle3_assets.engines.http.samples import SampleRequest, SamplingSettings
from eagle3_assets.engines.http.tool_flags import tool_flags
from eagle3_assets.engines.http.wire import FINISH, BackendUnavailable, Parsed, Prepared, base_row, now_iso, redactor, sample_seed
from eagle3_assets.target.tool_calls import reply_calls

ENDPOINTS = {"chat": "/chat/completions", "completions": "/completions"}


class OpenAIIdsBackend:
    """An OpenAI-compatible ``/v1`` API asked for exact token ids (e.g. ``vllm serve``).

    ``base_urls``: one or more ``.../v1`` roots (data parallelism: the engine spreads client
    shards over them). ``model``: the served model name (``--served-model-name``); empty takes
    ``preferred_model`` (e.g. the target's served name) when the server lists it, else the one model
    ``GET /models`` lists. ``extra_body`` is merged into every request.
    """

    def __init__(self, base_urls, *, model: str = "", render_prompt: Callable[[list], list[int]] | None = None,
                 endpoint: str = "chat", api_key: str | None = None, extra_body: dict | None = None,
                 source: str = "vllm", preferred_model: str = "", stop_token_ids: list[int] | None = None):
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("OpenAIIdsBackend needs at least one base URL")
        if endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {endpoint!r}")
        if endpoint == "completions" and render_prompt is None:
            raise ValueError("endpoint 'completions' sends locally rendered prompt ids: give render_prompt")
        self.base_urls = [u.rstrip("/") for u in urls]
        self.model = model
        self.preferred_model = preferred_model
        self.render_prompt = render_prompt
        self.endpoint = endpoint
        self.source = source
        self._api_key = api_key
        self.redact = redactor(api_key)
        self.extra_body = dict(extra_body or {})
        self.stop_token_ids = list(stop_token_ids or [])

    def __repr__(self) -> str:
        return f"OpenAIIdsBackend(base_urls={self.base_urls!r}, model={self.model!r}, endpoint={self.endpoint!r})"

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}

    def prepare(self, req: SampleRequest, *, max_tokens: int, sampling: SamplingSettings) -> Prepared:
        local_ids = req.render(self.render_prompt) if self.render_prompt is not None else None
        payload = {"model": self.model, "max_tokens": max_tokens, "temperature": sampling.temperature,
                   "top_p": sampling.top_p, "stream": False, "return_token_ids": True}
        if self.stop_token_ids:
            payload["stop_token_ids"] = self.stop_token_ids
        if self.endpoint == "chat":
            payload["messages"] = req.messages
            if req.tools:
                payload["tools"] = req.tools
        else:
            payload["prompt"] = local_ids
        if sampling.temperature > 0:
            payload["seed"] = sample_seed(sampling, req)
        payload.update(self.extra_body)
        return Prepared(req, local_ids, payload)

    def request(self, prepared: Prepared, attempt: int) -> tuple[str, bytes]:
        body = dict(prepared.payload, model=self.model)  # the model name may be resolved in preflight
        return ENDPOINTS[self.endpoint], json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()

    def parse(self, prepared: Prepared, status: int, headers, body: bytes, *, latency_s: float, attempts: int,
              base_url: str) -> Parsed:
        data, ok = parse_json(body)
        outcome = classify(status, data if ok else body, headers)
        if not outcome.ok:
            return Parsed(Outcome(outcome.kind, outcome.reason, outcome.retry_after, outcome.cooldown,
                                  self.redact(outcome.message), outcome.status))
        c0 = data["choices"][0]
        output_ids = c0.get("token_ids")
        prompt_ids = data.get("prompt_token_ids") or c0.get("prompt_token_ids")
        if output_ids is None or not prompt_ids:
            return Parsed(Outcome("fail", "no_token_ids", status=status,
                                  message="the reply has no prompt_token_ids/token_ids: the server ignores "
                                          "return_token_ids (vLLM >= 0.10.2 honours it)"))
        output_ids, prompt_ids = [int(t) for t in output_ids], [int(t) for t in prompt_ids]
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        flags = []
        ct = usage.get("completion_tokens")
        if ct is None:
            ct = len(output_ids)
            flags.append("usage_missing")
        elif ct != len(output_ids):
            return Parsed(Outcome("fail", "output_ids_mismatch", status=status,
                                  message=f"{len(output_ids)} token_ids but usage.completion_tokens={ct}"))
        if prepared.prompt_ids is not None and prompt_ids != prepared.prompt_ids:
            if self.endpoint == "completions":
                return Parsed(Outcome("fail", "prompt_ids_mismatch", status=status,
                                      message="the server echoed other prompt ids than it was sent"))
            flags.append("prompt_differs_from_local")
        fr = c0.get("finish_reason")
        finish = FINISH.get(fr)
        if finish is None:
            finish = "error"
            flags.append(f"unknown_finish_reason:{fr}")
        msg = c0.get("message") or {}
        text = msg.get("content") if self.endpoint == "chat" else c0.get("text")
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        calls = reply_calls(msg.get("tool_calls"))
        flags += tool_flags(prepared.req, calls)
        row = base_row(prepared.req, self.source)
        row.update({
            "model": data.get("model") or self.model, "provider": base_url,
            "prompt_ids": prompt_ids, "output_ids": output_ids, "text": text, "reasoning": reasoning,
            "tool_calls": calls, "finish_reason": finish, "prompt_tokens": usage.get("prompt_tokens", len(prompt_ids)),
            "completion_tokens": ct, "cost_usd": 0.0, "latency_s": round(latency_s, 4), "attempts": attempts,
            "created_at": now_iso(), "reasoning_tokens": 0,
            "native_finish_reason": c0.get("stop_reason") if c0.get("stop_reason") is not None else fr,
            "generation_id": data.get("id"),
        })
        row["flags"] = list(flags)
        return Parsed(outcome, row, 0.0, tuple(flags))

    async def preflight(self, client, base_urls) -> tuple[dict, Outcome | None]:
        """``GET /models`` on every server: reachable, authorised, serving the same model."""
        info: dict = {"base_urls": list(self.base_urls), "endpoint": self.endpoint}
        served = None
        for url in self.base_urls:
            try:
                r = await client.get(url + "/models", timeout=60.0)
            except Exception as e:  # noqa: BLE001
                raise BackendUnavailable(self.redact(f"{url}/models: {type(e).__name__}: {e}")) from None
            if r.status_code == 401:
                return info, Outcome("stop", "unauthorized", message=self.redact(r.text[:300]), status=401)
            if r.status_code != 200:
                raise BackendUnavailable(f"{url}/models answered {r.status_code}")
            data, ok = parse_json(r.content)
            names = [m.get("id") for m in (data.get("data") or [])] if ok and isinstance(data, dict) else []
            if self.model and self.model not in names:
                raise BackendUnavailable(f"{url} serves {names}, not {self.model!r} (--served-model-name)")
            if not self.model:
                if self.preferred_model in names:
                    self.model = self.preferred_model
                elif len(names) == 1:
                    self.model = names[0]
                else:
                    raise BackendUnavailable(f"{url} serves {names}: name the model to use")
            if served is not None and set(names) != served:
                raise BackendUnavailable(f"{url} serves {names}, another server {sorted(served)}")
            served = set(names)
        info["model"] = self.model
        return info, None

    async def postflight(self, client, base_urls) -> dict:
        return {}


def openai_ids_backend(settings, render_prompt, served_name: str = "",
                       stop_token_ids: list[int] | None = None) -> OpenAIIdsBackend:
    """The backend for the generation servers ``settings`` (the ``vllm`` resource) names; the model is
    ``served_name`` when they list it. ``stop_token_ids``: the target's end of turn, sent with every request."""
    return OpenAIIdsBackend(settings.base_urls, preferred_model=served_name, stop_token_ids=stop_token_ids,
                            render_prompt=render_prompt, endpoint=settings.endpoint, api_key=settings.api_key or None)
