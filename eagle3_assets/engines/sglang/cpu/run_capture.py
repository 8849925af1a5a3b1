"""Run the in-process capture on SGLang's real ``ModelRunner`` on this CPU, for tests and benchmarks.

Started with SGLang's own interpreter (``.venv-sglang``) and :func:`server_environment`'s
``PYTHONPATH``: ``python -m eagle3_assets.engines.sglang.cpu.run_capture SPEC OUT``. ``SPEC`` is a
JSON file ``{"model": dir, "layer_ids": [...], "rows": [[ids], ...], "server_args": {...}}``; the
aux and final states of every row (one batch, one rank) go to ``OUT`` with ``torch.save``. A
:class:`CapturePoolError` is written as ``{"refused": message}`` instead, so a caller can check the
KV-pool refusals on the real ``ServerArgs``.
"""

from __future__ import annotations

import json
import socket
import sys
import time

CPU_SERVER_ARGS = {"device": "cpu", "attention_backend": "torch_native", "mem_fraction_static": 0.1}


def main(spec_path: str, out_path: str) -> None:
    import torch

    from eagle3_assets.engines.sglang.capture import CapturePoolError, SGLangCapture

    spec = json.loads(open(spec_path).read())
    rows = [list(map(int, r)) for r in spec["rows"]]
    with socket.socket() as s:  # the runner's own gloo group, one rank
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.perf_counter()
    try:
        capture = SGLangCapture(spec["model"], layer_ids=spec["layer_ids"], tp_rank=0, tp_size=1, gpu_id=0,
                                batch_tokens=sum(map(len, rows)), longest_row=max(map(len, rows)),
                                max_rows=len(rows), dtype=spec.get("dtype", "float32"), nccl_port=port,
                                server_args={**CPU_SERVER_ARGS, **spec.get("server_args", {})})
    except CapturePoolError as exc:
        torch.save({"refused": str(exc)}, out_path)
        return
    built = time.perf_counter() - start
    start = time.perf_counter()
    aux, last = capture(rows)
    torch.save({"aux": aux, "last": last, "layers_to_capture": capture.layers_to_capture,
                "pool_tokens": capture.pool_tokens, "build_s": built, "capture_s": time.perf_counter() - start},
               out_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
