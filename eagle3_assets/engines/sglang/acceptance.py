"""A drafter's acceptance measured by SGLang's own EAGLE-3 worker serving the drafter's SGLang export.

The SGLang counterpart of :mod:`eagle3_assets.engines.vllm.acceptance`. A server started with
``--speculative-algorithm EAGLE3 --speculative-draft-model-path <export>`` (top-k 1, ``k`` steps,
``k + 1`` draft tokens) decodes the prompts greedily through ``/generate``; each reply's
``meta_info`` carries SGLang's per-request counters: ``spec_verify_ct`` (verification steps),
``spec_num_proposed_drafts`` (draft tokens), ``spec_num_correct_drafts`` (accepted draft tokens) and
``spec_correct_drafts_histogram`` (steps by how many drafts they accepted). Summed over the prompts
they give the figures the project's evaluator reports: acceptance length ``1 + accepted / steps``
and the rate at each draft position. The outputs are compared with plain greedy decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from eagle3_assets.engines.roles import EngineAcceptance
from eagle3_assets.engines.roles import compare as engine_compare


def acceptance_from_meta(metas: Sequence[dict], k: int) -> dict:
    """Summed per-request counters -> drafts, draft tokens, accepted tokens, acceptance length and
    per-position rates (a step that accepted ``j`` drafts accepted positions ``0..j-1``)."""
    for i, meta in enumerate(metas):
        if "spec_verify_ct" not in meta:
            raise KeyError(f"reply {i} has no spec_verify_ct in meta_info: is the server speculating?")
    steps = sum(int(m["spec_verify_ct"]) for m in metas)
    draft_tokens = sum(int(m.get("spec_num_proposed_drafts", 0)) for m in metas)
    accepted = sum(int(m.get("spec_num_correct_drafts", 0)) for m in metas)
    hist = [0] * (k + 1)
    for m in metas:
        for j, n in enumerate(m.get("spec_correct_drafts_histogram") or []):
            hist[min(j, k)] += int(n)
    per_pos = [sum(hist[j + 1:]) / steps if steps else 0.0 for j in range(k)]
    return {"drafts": steps, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "acceptance_length": 1 + accepted / steps if steps else 1.0,
            "acceptance_length_no_bonus": accepted / steps if steps else 0.0, "per_position_rate": per_pos}


def measure_acceptance(base_url: str, prompts: Sequence[Sequence[int]], *, k: int, max_new_tokens: int,
                       concurrency: int = 1, greedy_reference: Sequence[Sequence[int]] | None = None,
                       stop_token_ids: Sequence[int] = (), timeout_s: float = 1800.0) -> EngineAcceptance:
    """Greedy completions of ``prompts`` (token ids) from a speculating SGLang server at ``base_url``;
    the counters in the replies are its acceptance. ``stop_token_ids``: extra ids to stop on."""
    import httpx

    with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=30.0)) as client:
        def complete(ids) -> dict:
            params = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
            if stop_token_ids:
                params["stop_token_ids"] = [int(t) for t in stop_token_ids]
            r = client.post(base_url.rstrip("/") + "/generate",
                            json={"input_ids": [int(t) for t in ids], "sampling_params": params})
            if r.status_code != 200:
                raise RuntimeError(f"{base_url}/generate answered {r.status_code}: {r.text[:300]}")
            return r.json()

        with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(prompts)))) as pool:
            replies = list(pool.map(complete, prompts))
    outputs = [[int(t) for t in r["output_ids"]] for r in replies]
    figures = acceptance_from_meta([r["meta_info"] for r in replies], k)
    rep = EngineAcceptance(k=k, prompts=len(prompts), output_tokens=sum(map(len, outputs)), outputs=outputs, **figures)
    if greedy_reference is not None:
        rep.matches_greedy = outputs == [list(g) for g in greedy_reference]
    return rep


def compare(project: dict, engine: EngineAcceptance) -> dict:
    """The project's evaluator (an ``AcceptanceReport.as_metadata()``) next to SGLang's counters."""
    return engine_compare(project, engine, "sglang")
