"""The SGLang loopback: SGLang's native ``/generate`` API over the shared app base (``apps.py``)."""

from __future__ import annotations

import secrets
import time

from .apps import STATUS_OF, LoopbackApp, error_reply
from .http import Reply, Request
from .tool_replies import with_tool_calls


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
