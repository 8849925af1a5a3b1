"""A drafter's acceptance measured by vLLM serving the target with the drafter's vLLM export.

The project's own decoder (:mod:`eagle3_assets.drafter.spec_decode`) measures acceptance by chain
speculative decoding against transformers; this module asks a real engine the same question: a
vLLM server started with ``--speculative-config '{"method": "eagle3", "model": <export>, ...}'``
decodes the held-out prompts greedily, and its Prometheus counters (``/metrics``, read before and
after) give drafts, draft tokens and accepted tokens. Acceptance length in SGLang's convention is
``1 + accepted / drafts`` (accepted draft tokens + the bonus token per verification step), the
figure the project's evaluator reports. Both count drafts accepted past ``max_tokens`` on the last
step, so the two figures are comparable as they stand. The outputs are also compared with plain
greedy decoding: speculation must not change them.

``python -m eagle3_assets.drafter.vllm_acceptance demo`` (the drafter stage's measurement by hand)
uses it on a trained recipe's export.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from eagle3_assets.engines.roles import EngineAcceptance
from eagle3_assets.engines.roles import compare as engine_compare

SPEC_PREFIX = "vllm:spec_decode_"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def parse_prometheus(text: str, prefix: str = SPEC_PREFIX) -> dict[str, float]:
    """``{"name{labels}": value}`` for the samples whose name starts with ``prefix``, summed over
    label sets that differ only by ``model_name``/``engine`` (one engine here)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        keep = [p for p in labels.strip("{}").split(",") if p and p.split("=")[0] in ("position",)]
        key = name + ("{" + ",".join(keep) + "}" if keep else "")
        out[key] = out.get(key, 0.0) + value
    return out


def _counter(metrics: dict, name: str) -> float:
    for key in (f"{SPEC_PREFIX}{name}_total", f"{SPEC_PREFIX}{name}"):
        if key in metrics:
            return metrics[key]
    raise KeyError(f"{SPEC_PREFIX}{name}_total is not among the server's metrics: is speculative decoding on?")


def acceptance_from_counters(before: dict, after: dict, k: int) -> dict:
    drafts = int(_counter(after, "num_drafts") - _counter(before, "num_drafts"))
    draft_tokens = int(_counter(after, "num_draft_tokens") - _counter(before, "num_draft_tokens"))
    accepted = int(_counter(after, "num_accepted_tokens") - _counter(before, "num_accepted_tokens"))
    per_pos = []
    for j in range(k):
        key = f'{SPEC_PREFIX}num_accepted_tokens_per_pos_total{{position="{j}"}}'
        if key in after:
            per_pos.append((after[key] - before.get(key, 0.0)) / drafts if drafts else 0.0)
    return {"drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "acceptance_length_no_bonus": accepted / drafts if drafts else 0.0, "per_position_rate": per_pos}


def measure_acceptance(api_url: str, prompts: Sequence[Sequence[int]], *, k: int, max_new_tokens: int,
                       model: str = "", concurrency: int = 8, greedy_reference: Sequence[Sequence[int]] | None = None,
                       timeout_s: float = 1800.0, stop_token_ids: Sequence[int] = ()) -> EngineAcceptance:
    """Greedy completions of ``prompts`` (token ids) from a speculating vLLM server at ``api_url``
    (``.../v1``); the counters' difference over this batch is its acceptance. Nothing else may use
    the server meanwhile. ``stop_token_ids``: the target's end of turn (and eos ids), which vLLM
    does not stop on by itself when the config's ``eos_token_id`` is another id (Kimi-K2.5)."""
    import httpx

    root = api_url.rstrip("/").removesuffix("/v1")
    with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=30.0)) as client:
        if not model:
            model = client.get(api_url + "/models").json()["data"][0]["id"]

        def metrics() -> dict:
            r = client.get(root + "/metrics")
            r.raise_for_status()
            return parse_prometheus(r.text)

        def complete(ids) -> list[int]:
            body = {"model": model, "prompt": [int(t) for t in ids], "max_tokens": max_new_tokens,
                    "temperature": 0.0, "return_token_ids": True}
            if stop_token_ids:
                body["stop_token_ids"] = [int(t) for t in stop_token_ids]
            r = client.post(api_url + "/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"{api_url}/completions answered {r.status_code}: {r.text[:300]}")
            return [int(t) for t in r.json()["choices"][0]["token_ids"]]

        before = metrics()
        with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(prompts)))) as pool:
            outputs = list(pool.map(complete, prompts))
        after = metrics()
    figures = acceptance_from_counters(before, after, k)
    rep = EngineAcceptance(k=k, prompts=len(prompts), output_tokens=sum(map(len, outputs)), outputs=outputs, **figures)
    if greedy_reference is not None:
        rep.matches_greedy = outputs == [list(g) for g in greedy_reference]
    return rep


def compare(project: dict, engine: EngineAcceptance) -> dict:
    """The project's evaluator (``eval.json['trained']`` or an ``AcceptanceReport.as_metadata()``) next to vLLM's counters."""
    return engine_compare(project, engine, "vllm")
