"""Training-time-test attention: the fused ``scaled_dot_product_attention`` path the drafter
uses against the explicit softmax it replaced (scores materialised, masked, softmaxed), on the
same inputs: forward + backward time per TTT unroll, the bytes autograd keeps for the backward
pass, the largest output difference, and the ratios. CPU figures on the demo drafter's head
shape unless ``--heads``/``--head-dim`` say otherwise; on a GPU the fused path is the
memory-efficient kernel.

Run: ``.venv/bin/python benchmarks/ttt_attention.py [--tokens 1024] [--steps 7]``
"""

import argparse
import math
import time

import torch
from results import record

from eagle3_assets.drafter.model import TTTContext


def explicit(qs, ks, vs, scale):
    """The former formulation: step-0 scores over [T, T] plus the chain keys per index."""
    t = qs[0].shape[2]
    idx = torch.arange(t)
    mask = idx[None, :] <= idx[:, None]
    outs = []
    for s, q in enumerate(qs):
        scores = (q @ ks[0].transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
        if s == 0:
            outs.append(scores.softmax(-1) @ vs[0])
            continue
        chain_k, chain_v = torch.stack(ks[1: s + 1], -2), torch.stack(vs[1: s + 1], -2)
        probs = torch.cat([scores, (q[..., None, :] * chain_k).sum(-1) * scale], -1).softmax(-1)
        outs.append(probs[..., :t] @ vs[0] + (probs[..., t:, None] * chain_v).sum(-2))
    return outs


def fused(qs, ks, vs, scale):
    ctx = TTTContext(torch.ones(qs[0].shape[0], qs[0].shape[2], dtype=torch.bool))
    return [ctx.attend(q, k, v, scale) for q, k, v in zip(qs, ks, vs)]


def saved_bytes(fn, qs, ks, vs, scale) -> int:
    """Bytes autograd keeps for the backward pass of one unroll (inputs q/k/v excluded)."""
    inputs = {x.data_ptr() for x in (*qs, *ks, *vs)}
    seen: dict[int, int] = {}

    def pack(t):
        if t.data_ptr() not in inputs:
            seen[t.data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(qs, ks, vs, scale)
    return sum(seen.values())


def timed(fn, qs, ks, vs, scale, repeats):
    best = math.inf
    for _ in range(repeats):
        for x in (*qs, *ks, *vs):
            x.grad = None
        t0 = time.perf_counter()
        out = fn(qs, ks, vs, scale)
        sum(o.float().pow(2).sum() for o in out).backward()
        best = min(best, time.perf_counter() - t0)
    return best, [o.detach() for o in out]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.tokens, args.head_dim)
    qs, ks, vs = ([torch.randn(shape, generator=g).requires_grad_() for _ in range(args.steps)] for _ in range(3))
    scale = 1 / math.sqrt(args.head_dim)
    t_ref, ref = timed(explicit, qs, ks, vs, scale, args.repeats)
    t_new, new = timed(fused, qs, ks, vs, scale, args.repeats)
    diff = max(float((a - b).abs().max()) for a, b in zip(ref, new))
    m_ref, m_new = saved_bytes(explicit, qs, ks, vs, scale), saved_bytes(fused, qs, ks, vs, scale)
    print(f"TTT attention, {args.steps} steps, batch {args.batch}, {args.tokens} tokens, {args.heads} heads x "
          f"{args.head_dim}, torch threads {args.threads}: forward+backward per unroll")
    print(f"  explicit softmax (yardstick) {t_ref * 1000:8.1f} ms, {m_ref / 2**20:8.1f} MiB kept for backward")
    print(f"  scaled_dot_product_attention {t_new * 1000:8.1f} ms, {m_new / 2**20:8.1f} MiB kept for backward")
    print(f"  time ratio (yardstick / fused) {t_ref / t_new:.2f}x, memory ratio {m_ref / max(1, m_new):.1f}x, "
          f"max |diff| {diff:.2e}")
    record("ttt_attention", {"tokens": args.tokens, "steps": args.steps, "heads": args.heads, "head_dim": args.head_dim,
                             "threads": args.threads, "explicit_ms": t_ref * 1000, "fused_ms": t_new * 1000,
                             "explicit_mib": m_ref / 2**20, "fused_mib": m_new / 2**20, "time_ratio": t_ref / t_new,
                             "memory_ratio": m_ref / max(1, m_new), "max_abs_diff": diff})


if __name__ == "__main__":
    main()
