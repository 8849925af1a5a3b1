"""What the loopback servers generate with: the real embedded model, or synthetic ids.

``ModelGenerator`` runs :class:`EmbeddedModel.generate` on one worker thread and batches the
requests that arrive while it is busy (grouped by sampling settings), so concurrent HTTP requests
share forward passes the way a real server's continuous batching does, in miniature.

``SyntheticGenerator`` is for load tests only: it returns deterministic fake token ids (a hash of
the prompt) with no model at all. Its text says it is synthetic; never use it as data.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import math
from concurrent.futures import ThreadPoolExecutor

from .outputs import Output
from .tool_replies import ToolCaller


class ModelGenerator:
    synthetic = False

    def __init__(self, model, *, max_batch: int = 16):
        self.model = model
        self.name = model.name
        self.stop_ids = list(model.stop_ids)
        self.max_batch = max_batch
        self.vocab_size = len(model.tokenizer)
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.batches = 0
        self.max_batch_seen = 0

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return self.model.render_prompt(messages, tools)

    def tool_reply(self, prompt_ids: list[int], output_ids: list[int]):
        """The tool-call reply a tool-using target writes here, or None (see ``tool_replies``)."""
        if "_caller" not in self.__dict__:
            self._caller = ToolCaller(self.model.target_tokenizer)
        return self._caller.reply(prompt_ids, output_ids)

    def decode(self, ids: list[int]) -> str:
        return self.model.tokenizer.decode(ids, skip_special_tokens=True)

    def decode_with(self, ids: list[int], *, skip_special_tokens: bool, spaces_between_special_tokens: bool) -> str:
        """Decode as a Hugging Face slow tokenizer's ``_decode`` did under SGLang's detokenizer:
        with ``spaces_between_special_tokens`` the pieces around every added token (Kimi's
        ``<think>``, ``</think>``, tool-call markers and the specials) are joined with spaces."""
        tok = self.model.tokenizer
        added = tok.added_tokens_decoder
        pieces, run = [], []
        for i in ids:
            if i in added:
                if run:
                    pieces.append(tok.decode(run, skip_special_tokens=False))
                    run = []
                if not (skip_special_tokens and added[i].special):
                    pieces.append(added[i].content)
            else:
                run.append(i)
        if run:
            pieces.append(tok.decode(run, skip_special_tokens=False))
        return (" " if spaces_between_special_tokens else "").join(pieces)

    async def generate(self, prompt_ids: list[int], *, max_new_tokens: int, temperature: float = 0.0,
                       top_p: float = 1.0, seed: int = 0) -> Output:
        if self._queue is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="loopback-model")
            self._queue = asyncio.Queue()
            self._task = asyncio.get_running_loop().create_task(self._loop())
        fut = asyncio.get_running_loop().create_future()
        key = (max_new_tokens, float(temperature), float(top_p), int(seed) if temperature > 0 else 0)
        await self._queue.put((key, list(prompt_ids), fut))
        return await fut

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self._queue.get()
            items = [first]
            while len(items) < self.max_batch and not self._queue.empty():
                items.append(self._queue.get_nowait())
            groups: dict[tuple, list] = {}
            for key, ids, fut in items:
                groups.setdefault(key, []).append((ids, fut))
            for (max_new, temp, top_p, seed), members in groups.items():
                try:
                    call = functools.partial(self.model.generate, [ids for ids, _ in members], max_new_tokens=max_new,
                                             temperature=temp, top_p=top_p, seed=seed)
                    outs = await loop.run_in_executor(self._pool, call)
                    self.batches += 1
                    self.max_batch_seen = max(self.max_batch_seen, len(members))
                    for (ids, fut), g in zip(members, outs, strict=True):
                        if not fut.done():
                            fut.set_result(Output(list(g.output_ids), g.finish_reason, g.text, len(ids)))
                except Exception as e:  # noqa: BLE001 - hand the failure to every waiting request
                    for _, fut in members:
                        if not fut.done():
                            fut.set_exception(e)

    async def aclose(self) -> None:
        """Stop the batching loop (on the loop that runs it); the model itself stays loaded."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except BaseException:  # noqa: BLE001 - CancelledError expected
                pass
            self._task, self._queue = None, None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


class SyntheticGenerator:
    """Deterministic fake ids for load tests (NOT model output)."""

    synthetic = True
    name = "synthetic-loopback"

    def __init__(self, *, stop_id: int = 2, vocab_size: int = 49152, lengths: str = "uniform",
                 median: float = 64.0, sigma: float = 1.0):
        """``lengths``: ``uniform`` (1 to 1.5 x max_tokens) or ``lognormal`` (heavy-tailed: ``median``
        tokens, log-scale spread ``sigma``, cut at max_tokens), both a deterministic hash of the prompt."""
        if lengths not in ("uniform", "lognormal"):
            raise ValueError(f"unknown length distribution {lengths!r}")
        self.stop_ids = [stop_id]
        self.vocab_size = vocab_size
        self.lengths, self.median, self.sigma = lengths, median, sigma

    def _length(self, h: bytes, max_new_tokens: int) -> int:
        if self.lengths == "lognormal":
            u1 = (int.from_bytes(h[:4], "big") + 0.5) / 2**32
            u2 = (int.from_bytes(h[28:32], "big") + 0.5) / 2**32
            z = math.sqrt(-2.0 * math.log(u1)) * math.cos(2 * math.pi * u2)  # Box-Muller
            return max(1, int(round(self.median * math.exp(self.sigma * z))))
        span = max_new_tokens + max_new_tokens // 2
        return 1 + int.from_bytes(h[:4], "big") % max(1, span)

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        raw = json.dumps([messages, tools] if tools else messages, sort_keys=True, ensure_ascii=False).encode()
        return [100 + int.from_bytes(raw[i:i + 4], "big") % (self.vocab_size - 100) for i in range(0, len(raw), 4)]

    def decode(self, ids: list[int]) -> str:
        return "[synthetic] " + " ".join(f"t{i}" for i in ids if i not in self.stop_ids)

    async def generate(self, prompt_ids: list[int], *, max_new_tokens: int, temperature: float = 0.0,
                       top_p: float = 1.0, seed: int = 0) -> Output:
        return self.generate_now(prompt_ids, max_new_tokens=max_new_tokens, seed=seed if temperature > 0 else 0)

    def generate_now(self, prompt_ids: list[int], *, max_new_tokens: int, seed: int = 0) -> Output:
        h = hashlib.sha256(json.dumps([prompt_ids[-64:], len(prompt_ids), seed]).encode()).digest()
        length = self._length(h, max_new_tokens)
        ids = [100 + (h[4 + (i % 28)] * 131 + i * 7919) % (self.vocab_size - 100)
               for i in range(min(length, max_new_tokens))]
        if length < max_new_tokens:
            ids = ids[: length - 1] + [self.stop_ids[0]]
            reason = "stop"
        else:
            reason = "length"
        return Output(ids, reason, self.decode(ids), len(prompt_ids))

    async def aclose(self) -> None:
        pass
