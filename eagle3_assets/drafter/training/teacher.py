"""The teacher (the target's own head on the stored final states) and the TTT loss terms.

The teacher lives on the training device in the compute dtype: the full-vocabulary argmax
and the draft-vocabulary logits are matmuls against the target's ``lm_head`` there, chunked
over tokens so a [tokens, V] block stays bounded (V = 163,840 for Kimi-K2.5). Only the
draft-vocabulary softmax is taken in float32.

The loss terms compare the draft distribution q with the target's p over the draft vocabulary
at each counted position: forward KL (as soft cross-entropy, ``kl``), total variation
``tv = 1 - alpha`` and ``nla = -log alpha``, where ``alpha = sum min(p, q)`` is the acceptance
rate of speculative sampling (arXiv 2602.23881's LK losses build on it; ``lk`` blends KL and TV
with a weight the trainer sets from the batch's alpha).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle3_assets.drafter.model import shift_left
from eagle3_assets.drafter.vocab_map import VocabMap

LOGITS_PER_CHUNK = 1 << 26  # elements of one [tokens, V] argmax block on a CPU (256 MiB in float32)
LOGITS_PER_CHUNK_GPU = 1 << 28  # on a GPU (512 MiB in bf16): 1,638 rows of Kimi-K2.5's vocabulary a matmul
TERMS = ("kl", "tv", "nla", "positions", "agree")  # per TTT step, summed over this rank's positions


class Teacher:
    """The target's next-token distribution restricted to the draft vocabulary."""

    def __init__(self, lm_head: torch.Tensor, vmap: VocabMap, *, device="cpu", dtype=torch.float32):
        self.head = lm_head.to(device=device, dtype=dtype)  # [V, H]
        self.draft_head = self.head[vmap.target_ids.to(self.head.device)].contiguous()  # [N, H]
        self.t2d = vmap.t2d.to(self.head.device)
        self.t2d_host = vmap.t2d.cpu()
        per_chunk = LOGITS_PER_CHUNK_GPU if self.head.is_cuda else LOGITS_PER_CHUNK
        self.chunk = max(1, per_chunk // self.head.shape[0])

    @torch.no_grad()
    def target_ids(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary argmax of the target logits [B, T]."""
        flat = last_hidden.reshape(-1, last_hidden.shape[-1]).to(self.head.dtype)
        if not flat.numel():
            return torch.zeros(last_hidden.shape[:-1], dtype=torch.long, device=flat.device)
        out = torch.cat([(c @ self.head.T).argmax(-1) for c in flat.split(self.chunk)])
        return out.view(last_hidden.shape[:-1])

    @torch.no_grad()
    def __call__(self, last_hidden: torch.Tensor, target_ids: torch.Tensor | None = None):
        """(probs [B, T, N] float32, target argmax ids [B, T], argmax-in-draft-vocab [B, T]);
        ``target_ids`` when the argmax is known already (``TargetIdCache``)."""
        if target_ids is None:
            target_ids = self.target_ids(last_hidden)
        return self.draft_logits(last_hidden).float().softmax(-1), target_ids, self.t2d[target_ids]

    @torch.no_grad()
    def draft_logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """The target's logits over the draft vocabulary [..., N], in the teacher's dtype (the
        trainer softmaxes them chunk by chunk, so no [tokens, N] float32 block is held)."""
        return last_hidden.to(self.draft_head.dtype) @ self.draft_head.T


class TargetIdCache:
    """The target's full-vocabulary argmax at each sample's teacher rows, computed in the first
    epoch and reused after: the stored states never change, so neither does the argmax, and
    the [tokens, V] matmul behind it is a quarter of a CPU step for SmolLM2 (V = 49,152).
    Holds int32 ids of at most ``max_tokens`` rows on the host (256 MiB at most); samples past
    that are recomputed. Ids come back on the host: from a cached batch the trainer learns which
    rows count without waiting on the device."""

    def __init__(self, teacher: Teacher, max_tokens: int = 1 << 26):
        self.teacher, self.max_tokens = teacher, max_tokens
        self.store: dict[str, torch.Tensor] = {}
        self.tokens = 0

    def __call__(self, keys: list[str] | None, packed) -> torch.Tensor:
        """Target ids [R] of ``packed.teacher_rows`` (a ``PackedBatch`` of the samples ``keys``):
        on the host when ``keys`` name the samples, else on the device."""
        hidden = packed.last_hidden[packed.teacher_rows]
        if keys is None:
            return self.teacher.target_ids(hidden)
        owner = packed.sample_host[packed.teacher_rows_host]
        ends = torch.bincount(owner, minlength=len(keys)).cumsum(0).tolist()  # rows of a sample are contiguous
        out = torch.empty(owner.numel(), dtype=torch.int32)
        todo = []
        for b, key in enumerate(keys):
            a, z = (ends[b - 1] if b else 0), ends[b]
            if key in self.store:
                out[a:z] = self.store[key]
            elif z > a:
                todo.append((key, a, z))
        if todo:
            at = torch.cat([torch.arange(a, z) for _, a, z in todo])
            fresh = self.teacher.target_ids(hidden[at.to(hidden.device)]).to("cpu", torch.int32)
            out[at] = fresh
            for key, a, z in todo:
                if self.tokens + (z - a) <= self.max_tokens:
                    self.store[key] = out[a:z].clone()
                    self.tokens += z - a
        return out.long()


def position_terms(p: torch.Tensor, logits: torch.Tensor, need: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Per-position ``kl`` (soft cross-entropy), ``tv`` and ``nla`` of draft ``logits`` against
    target probabilities ``p`` (both [..., N]); only the terms in ``need`` carry gradients."""
    logq = F.log_softmax(logits.float(), dim=-1)
    out = {"kl": -(p * logq).sum(-1)}
    with torch.set_grad_enabled(torch.is_grad_enabled() and any(t in need for t in ("tv", "nla"))):
        alpha = torch.minimum(p, logq.exp()).sum(-1)
        out["tv"] = 1.0 - alpha
        out["nla"] = -torch.log(alpha.clamp(min=1e-6))
    return {k: v if k in need else v.detach() for k, v in out.items()}


def step_terms(logits_steps, packed, teacher_out, d2t: torch.Tensor, need: tuple[str, ...] = ("kl",)) -> list[dict]:
    """Per TTT step: sums over this rank's counted positions of every term in ``TERMS``.

    ``packed`` is the batch as a ``drafter.packing.PackedBatch`` whose ``count`` set the rows
    each step counts; ``logits_steps[s]`` are the draft logits of those rows, and ``teacher_out``
    the teacher's output on ``packed.teacher_rows``. Row r of step s is compared with the teacher
    at r + 1 + s, the distribution of the token at r + 2 + s.
    """
    probs, target_ids = teacher_out[0][0], teacher_out[1][0]  # [R, N], [R]
    slot = torch.full((packed.n,), -1, dtype=torch.long, device=probs.device)
    slot[packed.teacher_rows] = torch.arange(packed.teacher_rows.numel(), device=probs.device)
    out = []
    for s, logits in enumerate(logits_steps):
        at = slot[packed.logit_rows[s] + 1 + s]  # the teacher's row for each counted row
        terms = {k: v.sum() for k, v in position_terms(probs[at], logits, need).items()}
        pred = logits.argmax(-1)
        agree = (pred + d2t[pred]) == target_ids[at]
        out.append({**terms, "positions": probs.new_tensor(float(at.numel())), "agree": agree.float().sum()})
    return out


def padded_step_terms(logits_steps, batch: dict, teacher_out, d2t: torch.Tensor, need: tuple[str, ...] = ("kl",)) -> list[dict]:
    """:func:`step_terms` on the right-padded batch itself (logits [B, T, N] per step, the
    teacher on every position): the same sums with the work on padding, kept as the yardstick
    the packed path is measured against (``benchmarks/drafter.py``)."""
    probs, target_ids, in_draft = teacher_out
    supervised = (batch["loss_mask"] > 0) & (batch["attention_mask"] > 0)
    out = []
    for s, logits in enumerate(logits_steps):
        mask = shift_left(supervised, s + 2, fill=False) & shift_left(in_draft, s + 1, fill=False)
        m = mask.float()
        terms = {k: (v * m).sum() for k, v in position_terms(shift_left(probs, s + 1, fill=0.0), logits, need).items()}
        pred = logits.argmax(-1)
        agree = ((pred + d2t[pred]) == shift_left(target_ids, s + 1, fill=-1)) & mask
        out.append({**terms, "positions": m.sum(), "agree": agree.float().sum()})
    return out
