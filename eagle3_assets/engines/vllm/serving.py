"""What the serving benchmark asks of vLLM: streamed, timed completions of token ids, and the
acceptance of a batch from the ``/metrics`` counters read before and after it."""

from __future__ import annotations

from collections.abc import Sequence

from eagle3_assets.engines.stream import Streamed, stream_request
from eagle3_assets.engines.vllm.acceptance import acceptance_from_counters, parse_prometheus


def _parse(event: dict, _so_far: list[int]) -> tuple[list[int], dict | None]:
    choices = event.get("choices") or []
    if not choices:
        return [], None  # the usage chunk
    ids = choices[0].get("token_ids")
    if ids is None and choices[0].get("text"):
        raise RuntimeError("vLLM streamed text without token_ids: it must support return_token_ids")
    return list(ids or []), None


def timed_completion(client, api_url: str, model: str, ids: Sequence[int], *, max_new_tokens: int,
                     stop_token_ids: Sequence[int] = ()) -> Streamed:
    if not model:
        model = _served_model(client, api_url)
    body = {"model": model, "prompt": [int(t) for t in ids], "max_tokens": max_new_tokens, "temperature": 0.0,
            "return_token_ids": True, "stream": True}
    if stop_token_ids:
        body["stop_token_ids"] = [int(t) for t in stop_token_ids]
    return stream_request(client, api_url.rstrip("/") + "/completions", body, _parse)


_MODELS: dict[str, str] = {}


def _served_model(client, api_url: str) -> str:
    if api_url not in _MODELS:
        _MODELS[api_url] = client.get(api_url.rstrip("/") + "/models").json()["data"][0]["id"]
    return _MODELS[api_url]


def counters(client, api_url: str) -> dict:
    r = client.get(api_url.rstrip("/").removesuffix("/v1") + "/metrics")
    r.raise_for_status()
    return parse_prometheus(r.text)


def batch_acceptance(before: dict, after: dict, replies: Sequence[Streamed], steps: int) -> dict:
    """The batch's drafts and accepted tokens from the server's counters (nothing else ran meanwhile)."""
    return acceptance_from_counters(before, after, steps)


def user_command(model_dir, drafter_dir, steps: int) -> str:
    """The command a user runs to serve the target with this export at ``steps`` draft tokens."""
    import json

    from eagle3_assets.engines.vllm.server import speculative_config

    spec = json.dumps(speculative_config(drafter_dir, steps))
    return f"vllm serve {model_dir} --speculative-config '{spec}'"
