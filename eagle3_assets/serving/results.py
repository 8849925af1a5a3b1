"""From the journal's cells to what a user reads: rows with speedups, mismatches against the
baseline, and the best setting per engine and concurrency.

The reference output of a prompt is the engine's baseline at its lowest concurrency: greedy
decoding of the target alone. Every other cell's output for that prompt must equal it token for
token. A speedup is a cell's output tokens/s over the baseline cell of the same engine, concurrency
and category; the ``all`` rows pool the categories (tokens over summed wall time, accepted tokens
over summed verification steps).
"""

from __future__ import annotations

from eagle3_assets.serving.provenance import complete
from eagle3_assets.serving.timing import speedup

ALL = "all"


def _reference(entries: list[dict]) -> dict[str, dict[str, list[int]]]:
    """engine -> prompt id -> the baseline's output at the engine's lowest concurrency."""
    base = [e for e in entries if e["setting"]["steps"] == 0]
    lowest = {e["engine"]: min(b["concurrency"] for b in base if b["engine"] == e["engine"]) for e in base}
    ref: dict[str, dict[str, list[int]]] = {}
    for e in base:
        if e["concurrency"] == lowest[e["engine"]]:
            ref.setdefault(e["engine"], {}).update(e["outputs"])
    return ref


def mismatches(entries: list[dict]) -> list[dict]:
    """Each (cell, prompt) whose output differs from the baseline's, with the first differing position
    (a prompt sent more than once in a cell, to fill its level, is compared once per reply)."""
    ref = _reference(entries)
    found = []
    for e in entries:
        base = ref.get(e["engine"], {})
        replies = [*e["outputs"].items(), *((pid, ids) for pid, more in e.get("copy_outputs", {}).items() for ids in more)]
        for pid, ids in replies:
            want = base.get(pid)
            if want is None or ids == want:
                continue
            at = next((i for i, (a, b) in enumerate(zip(ids, want)) if a != b), min(len(ids), len(want)))
            found.append({"engine": e["engine"], "setting": e["label"], "concurrency": e["concurrency"],
                          "category": e["category"], "prompt": pid, "first_difference_at": at,
                          "tokens": len(ids), "baseline_tokens": len(want)})
    return found


def _pool(cells: list[dict]) -> dict:
    tokens = sum(c["figures"]["output_tokens"] for c in cells)
    wall = sum(c["figures"]["wall_s"] for c in cells)
    reqs = sum(c["figures"]["requests"] for c in cells)
    tpots = [c["figures"]["tpot_s"] for c in cells if c["figures"]["tpot_s"] is not None]
    fig = {"requests": reqs, "output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall else 0.0,
           "ttft_s": sum(c["figures"]["ttft_s"] * c["figures"]["requests"] for c in cells) / reqs if reqs else 0.0,
           "tpot_s": sum(tpots) / len(tpots) if tpots else None}
    accs = [c["acceptance"] for c in cells if c.get("acceptance")]
    acc = None
    if accs:
        drafts = sum(a["drafts"] for a in accs)
        accepted = sum(a["accepted_tokens"] for a in accs)
        acc = {"drafts": drafts, "accepted_tokens": accepted, "acceptance_length": 1 + accepted / drafts if drafts else 1.0}
    return {"figures": fig, "acceptance": acc}


def rows(entries: list[dict]) -> list[dict]:
    """One row per engine x setting x concurrency x category, plus the pooled ``all`` row of each
    engine x setting x concurrency; only cells whose provenance is complete."""
    shown = [e for e in entries if complete(e.get("provenance") or {})]
    groups: dict[tuple, list[dict]] = {}
    for e in shown:
        groups.setdefault((e["engine"], e["label"], e["concurrency"]), []).append(e)
    per = {(e["engine"], e["label"], e["concurrency"], e["category"]): e for e in shown}
    per.update({(*k, ALL): {**v[0], **_pool(v), "category": ALL} for k, v in groups.items()})
    bad = {(m["engine"], m["setting"], m["concurrency"], m["category"]) for m in mismatches(shown)}
    out = []
    for (engine, label, conc, cat), e in per.items():
        base = per.get((engine, "baseline", conc, cat))
        acc = e.get("acceptance")
        out.append({"engine": engine, "setting": label, "steps": e["setting"]["steps"], "topk": e["setting"]["topk"],
                    "draft_tokens": e["setting"]["draft_tokens"], "concurrency": conc, "category": cat,
                    "acceptance_length": round(acc["acceptance_length"], 4) if acc else None,
                    "tokens_per_s": round(e["figures"]["tokens_per_s"], 3),
                    "tpot_ms": round(1000 * e["figures"]["tpot_s"], 2) if e["figures"]["tpot_s"] is not None else None,
                    "ttft_ms": round(1000 * e["figures"]["ttft_s"], 1),
                    "speedup": round(s, 3) if base and (s := speedup(e["figures"], base["figures"])) else None,
                    "outputs_equal_baseline": not any(b[:3] == (engine, label, conc) and (cat == ALL or b[3] == cat)
                                                      for b in bad),
                    "provenance": e["provenance"]})
    order = {c: i for i, c in enumerate(dict.fromkeys(r["category"] for r in out if r["category"] != ALL))}
    return sorted(out, key=lambda r: (r["engine"], r["concurrency"], r["steps"], r["topk"], r["draft_tokens"],
                                      order.get(r["category"], -1)))


def best_settings(table: list[dict]) -> dict:
    """engine -> concurrency -> the pooled row of the fastest setting whose outputs equal the baseline's."""
    best: dict = {}
    for r in table:
        if r["category"] != ALL or r["steps"] == 0 or not r["outputs_equal_baseline"] or r["speedup"] is None:
            continue
        have = best.setdefault(r["engine"], {}).get(str(r["concurrency"]))
        if have is None or r["speedup"] > have["speedup"]:
            best[r["engine"]][str(r["concurrency"])] = r
    return best
