"""Which prompts of a dataset still have no response, and why.

A prompt is answered when any source holds a row for it. For the others the reason is the last
error recorded for the prompt (``errors.jsonl``: e.g. ``retries_exhausted:http_503``, ``http_400``)
or, without one, how the dataset's last ``raw_responses`` run ended (``last_run.json``): the token
budget was spent, ``max_samples`` held it back, or the run was stopped.
"""

from __future__ import annotations

from eagle3_assets.generation.response_store import ResponseStore

ENDINGS = {"budget": "budget_spent", "max_new_samples": "max_samples", None: "not_generated"}


def unanswered(prompt_ids: list[str], answered: set[str], errors: list[dict], last_run: dict | None) -> list[dict]:
    """One record per prompt without a row: prompt id, reason, detail."""
    last_error: dict[str, dict] = {}
    for e in errors:
        if e.get("prompt_id") is not None:
            last_error[e["prompt_id"]] = e
    ending = (last_run or {}).get("stopped_reason")
    default = ENDINGS.get(ending, f"run_stopped:{ending}")
    out = []
    for pid in prompt_ids:
        if pid in answered:
            continue
        e = last_error.get(pid)
        if e is not None:
            detail = f"{e.get('attempts')} attempt(s); {e.get('message') or ''}".strip().rstrip(";")
            out.append({"prompt_id": pid, "reason": e.get("reason"), "detail": detail[:300]})
        else:
            out.append({"prompt_id": pid, "reason": default, "detail": ""})
    return out


def unanswered_in_store(store: ResponseStore, prompt_ids: list[str], rows: list[dict] | None = None) -> list[dict]:
    rows = store.rows() if rows is None else rows
    return unanswered(prompt_ids, {r.get("prompt_id") for r in rows}, store.errors(), store.last_run())
