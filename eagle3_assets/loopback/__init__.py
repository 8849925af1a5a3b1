"""Loopback HTTP servers: try the SGLang and OpenRouter generation paths without a GPU or a key.

Real HTTP on 127.0.0.1 (asyncio, a minimal HTTP/1.1 keep-alive server), speaking

* **SGLang's native API** - ``POST /generate`` with ``input_ids`` and ``rid``, answering
  ``text``, ``output_ids`` (stop token included) and ``meta_info {id, finish_reason {type,
  matched|length}, prompt_tokens, completion_tokens}``; ``GET /health_generate``, ``/model_info``.
  ``--prefix-bug P`` reproduces SGLang's known bug (``output_ids`` prefixed by prompt tokens).
* **OpenRouter** - ``POST /api/v1/chat/completions`` (non-streaming) with ``usage {prompt_tokens,
  completion_tokens, completion_tokens_details.reasoning_tokens, cost}``, ``provider`` and
  ``model``; ``GET /api/v1/key`` (``usage`` = dollars billed so far, from ``--key-usage`` on) and
  ``/api/v1/models``. A generation whose client hangs up is finished and billed, as providers bill
  non-streaming requests in flight; the server's own per-request ledger
  (:mod:`~eagle3_assets.loopback.ledger`) tells delivered replies from billed, undelivered ones.

Both answer with the real embedded model (SmolLM2-135M, batched opportunistically) unless
``--synthetic`` is given: then the replies are deterministic fake token ids, **for load tests
only** (their text starts with ``[synthetic]``). Faults are injected per server, seeded, by
probability and/or a scripted sequence; see :mod:`eagle3_assets.loopback.faults`.

Usage::

    python -m eagle3_assets.loopback sglang --port 30000
    python -m eagle3_assets.loopback openrouter --port 8080 --api-key sk-test \\
        --faults 429=0.05,502=0.05,heartbeat=0.2,drop=0.01 --seed 1
    python -m eagle3_assets.loopback sglang --port 30001 --synthetic --latency 1.5 --faults slow=0.1

    # then point the engine at it, e.g.
    #   SGLangBackend(["http://127.0.0.1:30000"], render_prompt=model.render_prompt)
    #   OpenRouterBackend(api_key="sk-test", model="any/slug", base_url="http://127.0.0.1:8080/api/v1")
    curl -s localhost:30000/_loopback/stats   # requests, faults, generations, billed dollars
    curl -s 'localhost:8080/_loopback/stats?gate=2000'   # plus the ledger and the full-gate share

The server prints ``listening on http://127.0.0.1:PORT`` once it accepts connections (``--port 0``
picks a free port). In tests, :func:`serve_in_thread` runs an app inside the test process.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

from .apps import LoopbackApp, messages_key
from .faults import FAULTS, FaultPlan
from .generators import ModelGenerator, SyntheticGenerator
from .openrouter_app import OpenRouterApp
from .sglang_app import SGLangApp

__all__ = [
    "FAULTS", "FaultPlan", "LoopbackApp", "ModelGenerator", "OpenRouterApp", "SGLangApp",
    "SyntheticGenerator", "ThreadedServer", "messages_key", "serve_in_thread",
]


@dataclass
class ThreadedServer:
    app: LoopbackApp
    url: str
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread

    def stats(self) -> dict:
        return self.call(self.app.stats)

    def call(self, fn, *args):
        """Run ``fn`` on the server's loop thread and return its result."""
        async def run():
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def stop(self) -> None:
        async def close():
            await self.app.aclose()
            me = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not me]
            for t in rest:  # handlers still sleeping on slow replies
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
        try:
            asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

    def __enter__(self) -> ThreadedServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_in_thread(app: LoopbackApp, host: str = "127.0.0.1", port: int = 0) -> ThreadedServer:
    """Start ``app`` on its own event loop in a daemon thread; returns once it is listening."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box: dict = {}

    def main():
        asyncio.set_event_loop(loop)
        try:
            box["server"] = loop.run_until_complete(app.start(host, port))
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            box["error"] = e
            started.set()
            return
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=main, name=f"loopback-{app.name}", daemon=True)
    thread.start()
    started.wait(30)
    if "error" in box:
        raise box["error"]
    return ThreadedServer(app, box["server"].url, loop, thread)
