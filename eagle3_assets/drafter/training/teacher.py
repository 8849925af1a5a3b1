"""The teacher (the target's own head on the stored final states) and the TTT loss terms.

The teacher lives on the training device in the compute dtype: the full-vocabulary argmax
and the draft-vocabulary logits are matmuls against the target's ``lm_head`` there, chunked
over tokens so a [tokens, V] block stays bounded (V = 163,840 for Kimi-K2.5). Only the
draft-vocabulary softmax is taken in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle3_assets.drafter.model import shift_left
from eagle3_assets.drafter.vocab_map import VocabMap

LOGITS_PER_CHUNK = 1 << 26  # elements of one [tokens, V] argmax block (128 MiB in bf16)


class Teacher:
    """The target's next-token distribution restricted to the draft vocabulary."""

    def __init__(self, lm_head: torch.Tensor, vmap: VocabMap, *, device="cpu", dtype=torch.float32):
        self.head = lm_head.to(device=device, dtype=dtype)  # [V, H]
        self.draft_head = self.head[vmap.target_ids.to(self.head.device)].contiguous()  # [N, H]
        self.t2d = vmap.t2d.to(self.head.device)
        self.chunk = max(1, LOGITS_PER_CHUNK // self.head.shape[0])

    @torch.no_grad()
    def target_ids(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary argmax of the target logits [B, T]."""
        flat = last_hidden.reshape(-1, last_hidden.shape[-1]).to(self.head.dtype)
        if not flat.numel():
            return torch.zeros(last_hidden.shape[:-1], dtype=torch.long, device=flat.device)
        out = torch.cat([(c @ self.head.T).argmax(-1) for c in flat.split(self.chunk)])
        return out.view(last_hidden.shape[:-1])

    @torch.no_grad()
    def __call__(self, last_hidden: torch.Tensor):
        """(probs [B, T, N] float32, target argmax ids [B, T], argmax-in-draft-vocab [B, T])."""
        target_ids = self.target_ids(last_hidden)
        logits = last_hidden.to(self.draft_head.dtype) @ self.draft_head.T
        return logits.float().softmax(-1), target_ids, self.t2d[target_ids]


def step_terms(logits_steps, batch: dict, teacher_out, d2t: torch.Tensor) -> list[tuple]:
    """Per TTT step: (soft cross-entropy sum, positions counted, top-1 agreements) on this rank.

    Step s at index t predicts token t + 2 + s; it counts where that token is supervised and
    the target's argmax at t + 1 + s is in the draft vocabulary.
    """
    probs, target_ids, in_draft = teacher_out
    supervised = (batch["loss_mask"] > 0) & (batch["attention_mask"] > 0)
    terms = []
    for s, logits in enumerate(logits_steps):
        mask = shift_left(supervised, s + 2, fill=False) & shift_left(in_draft, s + 1, fill=False)
        p = shift_left(probs, s + 1, fill=0.0)
        ce = -(p * F.log_softmax(logits.float(), dim=-1)).sum(-1)  # [B, T]
        m = mask.float()
        pred = logits.argmax(-1)
        agree = ((pred + d2t[pred]) == shift_left(target_ids, s + 1, fill=-1)) & mask
        terms.append(((ce * m).sum(), m.sum(), agree.float().sum()))
    return terms
