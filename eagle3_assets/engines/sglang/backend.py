"""SGLang's native API on the wire: ``POST /generate`` with locally rendered prompt ids."""

from __future__ import annotations

import json
from collections.abc import Callable

from eagle3_assets.engines.http.classify import Outcome, classify, parse_json
from eagle3_assets.engines.http.samples import SampleRequest, SamplingSettings
from eagle3_assets.engines.http.tool_flags import tool_flags
from eagle3_assets.engines.http.wire import FINISH, BackendUnavailable, Parsed, Prepared, base_row, now_iso, redactor, sample_seed


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
        self.redact = redactor(api_key)
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
        row = base_row(prepared.req, self.source)
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


def sglang_backend(settings, render_prompt, *, stop_token_ids: list[int] | None = None,
                   parse_tool_calls=None) -> SGLangBackend:
    """The backend for the servers ``settings`` (the ``sglang`` resource) names. ``stop_token_ids``: the
    target's end of turn, sent with every request (a Kimi-K2.5 config's ``eos_token_id`` is not it);
    ``parse_tool_calls(output_ids)`` reads a reply's calls."""
    sampling = {"stop_token_ids": list(stop_token_ids)} if stop_token_ids else None
    return SGLangBackend(settings.base_urls, render_prompt, api_key=settings.api_key or None,
                         health_check=settings.health_check, repair_prefix_bug=settings.repair_prefix_bug,
                         text_options=settings.text_options(), sampling_params=sampling,
                         parse_tool_calls=parse_tool_calls)
