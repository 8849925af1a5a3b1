"""The TTT loss terms of a packed batch, with the draft head and both softmaxes run in row chunks.

At Kimi-K2.5's sizes the loss side of a step is as large as the decoder layer: per counted row
and TTT step, the draft logits (32,000 wide), their float32 log-softmax, its exponential and the
teacher's float32 probabilities. Held for a whole 8 x 8,192-token batch that is over 100 GB.
Here each chunk of ``chunk_rows`` rows computes its head, the teacher's softmax (from the
teacher's logits in its own dtype, computed once per batch) and its summed terms, and keeps
only its input rows for backward (recomputed there), so the loss holds one chunk's
[rows, N] blocks at a time. With one chunk (``chunk_rows`` 0, or no more rows than that) it is
exactly :func:`~eagle3_assets.drafter.training.teacher.step_terms`'s arithmetic.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint as recompute_in_backward

from eagle3_assets.drafter.training.teacher import position_terms

SUMMED = ("kl", "tv", "nla", "agree")


def _chunk_sums(head, rows, teacher_logits, at, target_ids, d2t, need) -> tuple[torch.Tensor, ...]:
    """Summed terms and agreements of draft rows ``rows`` [n, H] against the teacher's rows ``at``
    (gathered here, so a chunk kept for its recomputation holds the index, not a copy of the rows)."""
    logits = head(rows)
    terms = position_terms(teacher_logits[at].float().softmax(-1), logits, need)
    with torch.no_grad():
        pred = logits.argmax(-1)
        agree = ((pred + d2t[pred]) == target_ids[at]).float().sum()
    return (*(terms[k].sum() for k in SUMMED[:3]), agree)


def chunked_step_terms(head, hiddens: list[torch.Tensor], packed, teacher_logits: torch.Tensor, target_ids: torch.Tensor,
                       d2t: torch.Tensor, need: tuple[str, ...] = ("kl",), *, chunk_rows: int = 0) -> list[dict]:
    """Per TTT step, the sums of every term in ``teacher.TERMS`` over this batch's counted rows.

    ``hiddens[s]`` are step s's pre-norm hidden rows at ``packed.logit_rows[s]``; ``head`` maps
    them to draft logits; ``teacher_logits`` [R, N] and ``target_ids`` [R] are the teacher's on
    ``packed.teacher_rows``. Row r of step s is compared with the teacher at r + 1 + s. Called
    inside one autocast region (the trainer's), so the head's bf16 weight copy is made once.
    """
    slot = torch.full((packed.n,), -1, dtype=torch.long, device=teacher_logits.device)
    slot[packed.teacher_rows] = torch.arange(packed.teacher_rows.numel(), device=teacher_logits.device)
    out = []
    for s, hidden in enumerate(hiddens):
        at = slot[packed.logit_rows[s] + 1 + s]
        n = hidden.shape[0]
        size = n if chunk_rows <= 0 or n <= chunk_rows else chunk_rows
        recompute = size < n and torch.is_grad_enabled()
        sums = None
        for a in range(0, max(n, 1), max(size, 1)):
            args = (head, hidden[a:a + size], teacher_logits, at[a:a + size], target_ids, d2t, need)
            part = (recompute_in_backward(_chunk_sums, *args, use_reentrant=False, preserve_rng_state=False)
                    if recompute else _chunk_sums(*args))
            sums = part if sums is None else tuple(x + y for x, y in zip(sums, part))
        out.append({**dict(zip(SUMMED, sums)), "positions": teacher_logits.new_tensor(float(n), dtype=torch.float32)})
    return out
