"""What a drafter query may attend to: the training-time-test context and the decoding cache.

The decoder layer is the same in training and decoding; only the keys a query sees differ, and
that lives here. Both training contexts keep each unrolled step's keys in a list indexed by the
step (``at_step``): a step recomputed under activation checkpointing (its backward re-runs its
forward) replaces its own entry instead of appending a second one, so the recomputation sees
exactly the keys the first pass saw.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class StepKeys:
    """Keys and values of the unrolled steps so far; ``step`` is the one being computed."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.step: int | None = None  # None: append (each call is the next step)

    def at_step(self, step: int):
        self.step = step
        return self

    def push(self, k: torch.Tensor, v: torch.Tensor) -> int:
        """Record step ``self.step``'s keys (dropping any later ones); returns the steps now held."""
        s = len(self.keys) if self.step is None else self.step
        self.keys, self.values = [*self.keys[:s], k], [*self.values[:s], v]
        return s + 1


class TTTContext(StepKeys):
    """Training-time test attention over T positions unrolled for several steps.

    Entry (step j, index t) stands for the virtual sequence position t + j: the step-0 entries
    are built from the target's features, the later ones from the drafter's own outputs along
    the chain that starts after position t. A query (step s, index t) may see step-0 keys at
    indices u <= t and the keys (step j, index t) for 1 <= j <= s. Rotary positions are t + s,
    so relative distances are those of real chain decoding.

    Each step is one call of PyTorch's fused ``scaled_dot_product_attention`` over the keys of
    steps 0..s laid side by side ([T, (s+1)T] boolean mask: causal on the step-0 block, the
    diagonal on every later block), so no [T, T] score matrix is kept for backward. Batches
    are right-padded: a real query never reaches a padded key through the causal block, and a
    padded query (outside the loss) always sees key 0, so no row is empty.
    """

    def __init__(self, key_valid: torch.Tensor):
        super().__init__()
        if key_valid.shape[1] > 1 and bool((key_valid[:, 1:] > key_valid[:, :-1]).any()):
            raise ValueError("attention_mask must be right padding (ones, then zeros) in every row")
        t = key_valid.shape[1]
        idx = torch.arange(t, device=key_valid.device)
        self.causal = idx[None, :] <= idx[:, None]  # [T, T]
        self.diag = idx[None, :] == idx[:, None]

    def attend(self, q, k, v, scale: float) -> torch.Tensor:
        steps = self.push(k, v)
        if steps == 1:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        mask = torch.cat([self.causal, *([self.diag] * (steps - 1))], dim=-1)  # [T, (s+1)T]
        return F.scaled_dot_product_attention(q, torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2),
                                              attn_mask=mask, scale=scale)


class KVCache:
    """Keys/values of already processed entries for incremental decoding (batch of one or more)."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def truncate(self, length: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]

    def attend(self, q, k, v, scale: float) -> torch.Tensor:
        past = len(self)
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        t, total = q.shape[2], self.k.shape[2]
        qi = torch.arange(t, device=q.device)[:, None] + past
        mask = torch.arange(total, device=q.device)[None, :] <= qi  # [t, total]
        return F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask, scale=scale)
