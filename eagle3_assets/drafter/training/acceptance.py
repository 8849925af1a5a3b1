"""The acceptance estimate: a checkpoint's expected accepted length (EAL) on the eval split.

A serving chain of k drafts starts after a verified token; its drafts are accepted up to the
first one that differs from the target's greedy choice. On the stored eval states, the drafter's
training-time-test forward gives, at every reply position at once, the chain a verification
started there would draft (while its drafts are accepted, its inputs are the reply's own
tokens: ``drafter/replay_acceptance.py`` walks the real decoder over the same forward). For TTT
step s and chain start r whose s + 1 drafted tokens are all reply (supervised) tokens of r's
sample, the draft is right when it equals the target's argmax there, read from the stored final
state by the target's own head (a token outside the draft vocabulary is a rejected draft).

    a_s   = P(step s right | steps 0 .. s-1 right)     the conditional acceptance at position s
    EAL_k = 1 + sum_{s<k} prod_{j<=s} a_j               SGLang's convention: accepted + 1 per verification

The product of conditional rates is the share of chain starts that accept s + 1 drafts, so
``EAL_k - 1`` is the mean accepted length of a chain started at a reply position drawn
uniformly, with no assumption that a draft's errors are independent of the drafts before it.
SpecForge's simulated acceptance multiplies the unconditional (teacher-forced) accuracies
(``accuracy`` here) and counts no bonus token; speculators' EAL (DFlash) does the same per
batch. It stays an estimate: a decoder starts verifications only where the last one ended, and
on a sampled reply a chain's later inputs are the reply's tokens, not the target's argmax.

Cost: no target forward. The drafter's forward without gradients over ``eal_samples`` stored
eval samples at each checkpoint (a fraction of one training step per batch), and the teacher's
argmax once per sample (cached with the training samples').
"""

from __future__ import annotations

import time

import torch

from eagle3_assets.drafter.packing import PackedBatch
from eagle3_assets.drafter.training.distributed import all_reduce_sum

# Per TTT step s, over the chain starts whose s + 1 drafted tokens are reply tokens:
#   starts: such chain starts; chains: those whose drafts before s were all accepted;
#   accepted: those whose drafts through s were all accepted; right: those whose step-s draft is right
COUNTS = ("starts", "chains", "accepted", "right")
ROWS_PER_HEAD = 8192  # rows of the draft head at a time: 0.5 GB of bf16 logits at Kimi-K2.5's 32,000 drafts


def expected_accepted_length(rates: list[float], k: int) -> float:
    """``1 + sum_{s<k} prod_{j<=s} rates[j]``; ``rates`` the conditional acceptance per position."""
    out = survive = 1.0
    for a in rates[:k]:
        survive *= a
        out += survive
    return out


@torch.no_grad()
def chain_counts(model, packed: PackedBatch, target_ids: torch.Tensor, steps: int) -> torch.Tensor:
    """``COUNTS`` x ``steps`` (float64) of one packed batch; ``target_ids`` the target's argmax on
    ``packed.teacher_rows``. Sets the batch's rows with ``packed.count_chains``."""
    rows_per_step = packed.count_chains()
    hiddens = model(packed.input_ids, packed.aux_hidden, ttt_steps=steps, packed=packed, hidden_only=True)
    device = target_ids.device
    slot = torch.full((packed.n,), -1, dtype=torch.long, device=device)
    slot[packed.teacher_rows] = torch.arange(packed.teacher_rows.numel(), device=device)
    alive = torch.ones(packed.n, dtype=torch.bool, device=device)  # chain starts whose drafts so far were accepted
    out = torch.zeros(len(COUNTS), steps, dtype=torch.float64, device=device)
    for s, (rows, hidden) in enumerate(zip(rows_per_step, hiddens)):
        draft = model.draft_to_target(torch.cat([model.logits(h).argmax(-1) for h in hidden.split(ROWS_PER_HEAD)]))
        right = draft == target_ids[slot[rows + 1 + s]]  # row r's step s drafts the token the target picks at r + 1 + s
        before = alive[rows]
        alive = torch.zeros_like(alive)  # a start whose chain leaves the reply ends here
        alive[rows] = before & right
        out[:, s] = torch.stack([torch.tensor(rows.numel(), device=device), before.sum(), alive.sum(), right.sum()])
    return out


def estimate_figures(counts: list[list[float]], k: int) -> dict:
    """The estimate from summed ``COUNTS`` (rows of ``steps`` values): EAL at chain length
    ``k``, the conditional acceptance and the unconditional accuracy per position."""
    starts, chains, accepted, right = counts
    rates = [a / c if c else 0.0 for a, c in zip(accepted, chains)]
    return {"eal": expected_accepted_length(rates, k), "k": k, "acceptance_rate": rates,
            "accuracy": [r / n if n else 0.0 for r, n in zip(right, starts)], "chain_starts": int(starts[0])}


@torch.no_grad()
def estimate_acceptance(model, batches, prepare, target_ids_of, *, steps: int, k: int, autocast) -> dict:
    """The estimate of ``model`` (in eval mode) over ``batches``, all ranks together: each batch
    made ready by ``prepare``, the target's argmax from ``target_ids_of(keys, packed)`` (the
    trainer's cache), the drafter run under ``autocast()``."""
    t0, device = time.perf_counter(), next(model.parameters()).device
    counts = torch.zeros(len(COUNTS), steps, dtype=torch.float64, device=device)
    samples = torch.zeros((), dtype=torch.float64, device=device)
    for batch in batches:
        batch = prepare(batch)
        packed = PackedBatch(batch, steps)
        target_ids = target_ids_of(batch.get("keys"), packed).to(device)
        with autocast():
            counts += chain_counts(model, packed, target_ids, steps)
        samples += len(packed.bounds)
    totals = all_reduce_sum(torch.cat([counts.reshape(-1), samples.reshape(1)])).tolist()
    figures = estimate_figures([totals[i * steps:(i + 1) * steps] for i in range(len(COUNTS))], k)
    return {**figures, "samples": int(totals[-1]), "seconds": time.perf_counter() - t0}


def estimates_in(metrics: list[dict]) -> list[dict]:
    """Every checkpoint's estimate in a run's step metrics (where the trainer keeps them)."""
    return [m["acceptance_estimate"] for m in metrics if "acceptance_estimate" in m]


def best_estimate(estimates: list[dict], k: int) -> dict | None:
    """The estimate with the highest EAL at chain length ``k`` (the earliest of equals)."""
    best = None
    for e in estimates:
        if best is None or expected_accepted_length(e["acceptance_rate"], k) > \
                expected_accepted_length(best["acceptance_rate"], k):
            best = e
    return best


def estimate_summary(metrics: list[dict], k: int) -> dict:
    """What ``result.json`` and the asset report: every checkpoint's estimate (EAL at chain length
    ``k``), the best one's and the last one's; empty when the run scored none."""
    estimates = [{**e, "eal": expected_accepted_length(e["acceptance_rate"], k), "k": k} for e in estimates_in(metrics)]
    if not estimates:
        return {}
    best, last = best_estimate(estimates, k), estimates[-1]
    return {"eal_k": k, "eal_best": best["eal"], "eal_best_step": best["step"], "eal_last": last["eal"],
            "eal_last_step": last["step"], "acceptance_estimates": estimates}


def estimate_line(e: dict) -> str:
    rates = " ".join(f"{a:.2f}" for a in e["acceptance_rate"])
    return (f"step {e['step']}: acceptance estimate EAL {e['eal']:.3f} at k={e['k']} (conditional acceptance per "
            f"position {rates}; {e['samples']} held-out samples, {e['chain_starts']} chain starts, {e['seconds']:.1f} s)")


def exported_line(result: dict) -> str | None:
    """Which step a run exported and its estimate, from its ``result.json``; None before either existed."""
    if "exported_step" not in result:
        return None
    e = next((e for e in result.get("acceptance_estimates") or [] if e["step"] == result["exported_step"]), None)
    line = f"step {result['exported_step']} of {result['steps']}"
    if e is None:
        return line + " (the last; no acceptance estimate)"
    return (line + f", the best by the acceptance estimate: EAL {e['eal']:.3f} at k={e['k']} "
            f"(the last checkpoint's {result['eal_last']:.3f})")


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation of two lists of figures (ties share their mean rank): how well
    ``xs`` orders the items as ``ys`` does. None below three pairs or when either list is constant."""
    import math

    import polars as pl

    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} figures against {len(ys)}")
    if len(xs) < 3:
        return None
    rho = pl.DataFrame({"x": list(map(float, xs)), "y": list(map(float, ys))}).select(
        pl.corr("x", "y", method="spearman")).item()
    return None if rho is None or math.isnan(rho) else float(rho)
