"""What the serving benchmark asks of SGLang: streamed, timed ``/generate`` requests of token ids;
the acceptance of a batch from the per-request counters in each reply's ``meta_info``."""

from __future__ import annotations

from collections.abc import Sequence

from eagle3_assets.engines.sglang.acceptance import acceptance_from_meta
from eagle3_assets.engines.stream import Streamed, stream_request


def _parse(event: dict, so_far: list[int]) -> tuple[list[int], dict | None]:
    """SGLang streams ``output_ids`` whole so far (or only the new ones with ``--stream-output``)."""
    ids = [int(t) for t in event.get("output_ids") or []]
    n = len(so_far)
    new = ids[n:] if len(ids) >= n and ids[:n] == so_far else ids
    return new, event.get("meta_info")


def timed_generate(client, base_url: str, ids: Sequence[int], *, max_new_tokens: int,
                   stop_token_ids: Sequence[int] = ()) -> Streamed:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
    if stop_token_ids:
        params["stop_token_ids"] = [int(t) for t in stop_token_ids]
    body = {"input_ids": [int(t) for t in ids], "sampling_params": params, "stream": True}
    return stream_request(client, base_url.rstrip("/") + "/generate", body, _parse)


def batch_acceptance(replies: Sequence[Streamed], steps: int) -> dict:
    """The batch's verification steps and accepted drafts, summed over its replies' own counters."""
    return acceptance_from_meta([r.meta for r in replies], steps)


def user_command(model_dir, drafter_dir, steps: int, topk: int = 1, draft_tokens: int = 0) -> str:
    from eagle3_assets.engines.sglang.server import eagle3_args

    return " ".join(["python -m sglang.launch_server --model-path", str(model_dir),
                     *eagle3_args(drafter_dir, steps, topk, draft_tokens)])
