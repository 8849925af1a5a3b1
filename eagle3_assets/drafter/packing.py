"""Training on a batch without its padding: the samples laid back to back in one row.

A right-padded batch [B, T] spends every padded position on the fc, the decoder layer, the head
and the teacher's full-vocabulary matmul. All of those act on one token at a time; only attention
mixes tokens, and only within a sample. :class:`PackedBatch` keeps the N real tokens as one row
[1, N] (sample b's tokens contiguous, in order), gives each its position within its sample, and
attends sample by sample through :class:`PackedTTTContext` with the masks ``TTTContext`` uses:
the same network on the same tokens, so the loss and gradient are the padded batch's, less the
work on padding. The drafter's ``lm_head`` runs only on the rows a TTT step counts
(``logit_rows``) and the teacher only where a next token is supervised (``teacher_rows``).

Row r of step s predicts the token at r + 2 + s from the teacher at r + 1 + s; it counts when
both lie in r's sample, that token is supervised, and the target's argmax at r + 1 + s is in the
draft vocabulary (what ``teacher.step_terms`` counts on the padded batch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle3_assets.drafter.contexts import StepKeys


class PackedTTTContext(StepKeys):
    """Training-time-test attention over packed samples: per sample, step 0 is causal over its
    step-0 keys and step s > 0 adds the diagonal of each later step (see ``TTTContext``)."""

    def __init__(self, bounds: list[tuple[int, int]]):
        super().__init__()
        self.bounds = bounds
        self._masks: dict[tuple[int, int], torch.Tensor] = {}

    def _mask(self, n: int, steps: int, device) -> torch.Tensor:
        key = (n, steps)
        if key not in self._masks:
            idx = torch.arange(n, device=device)
            causal, diag = idx[None, :] <= idx[:, None], idx[None, :] == idx[:, None]
            self._masks[key] = torch.cat([causal, *([diag] * (steps - 1))], dim=-1)
        return self._masks[key]

    def attend(self, q, k, v, scale: float) -> torch.Tensor:
        steps, out = self.push(k, v), []
        for a, b in self.bounds:
            qs = q[:, :, a:b]
            if steps == 1:
                out.append(F.scaled_dot_product_attention(qs, k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=scale))
                continue
            ks = torch.cat([kk[:, :, a:b] for kk in self.keys], dim=2)
            vs = torch.cat([vv[:, :, a:b] for vv in self.values], dim=2)
            out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=self._mask(b - a, steps, q.device),
                                                      scale=scale))
        return torch.cat(out, dim=2)


class PackedBatch:
    """The real tokens of a right-padded batch as one row, with what the drafter and loss need."""

    def __init__(self, batch: dict, ttt_steps: int):
        valid = batch["attention_mask"].bool()
        lengths = valid.sum(-1).tolist()
        device = valid.device
        ends = torch.tensor(lengths, device=device).cumsum(0).tolist()
        self.bounds = [(e - n, e) for n, e in zip(lengths, ends) if n > 0]
        self.n = int(sum(lengths))
        self.sample = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                              torch.tensor(lengths, device=device))  # [N] sample of each row
        starts = torch.tensor([e - n for n, e in zip(lengths, ends)], device=device)
        self.positions = (torch.arange(self.n, device=device) - starts[self.sample])[None]  # [1, N]
        self.input_ids = batch["input_ids"][valid][None]
        self.aux_hidden = batch["aux_hidden"][valid][None]
        self.last_hidden = batch["last_hidden"][valid]  # [N, H]
        self.supervised = (batch["loss_mask"][valid] > 0)  # [N]
        self.ttt_steps = ttt_steps
        self.teacher_rows = torch.nonzero(self._same_sample(1) & self._ahead(self.supervised, 1)).flatten()
        self.logit_rows: list[torch.Tensor] = []

    def _ahead(self, x: torch.Tensor, n: int, fill=False) -> torch.Tensor:
        """x[r + n] at row r (``fill`` past the end); a sample boundary is the caller's to check."""
        if n >= x.shape[0]:
            return torch.full_like(x, fill)
        return torch.cat([x[n:], x.new_full((n, *x.shape[1:]), fill)])

    def _same_sample(self, n: int) -> torch.Tensor:
        return self._ahead(self.sample, n, fill=-1) == self.sample

    def shift(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        """[1, N] ids: the token n ahead in the same sample, 0 past its end (``shift_left`` per sample)."""
        return torch.where(self._same_sample(n), self._ahead(ids[0], n, fill=0), 0)[None]

    def context(self) -> PackedTTTContext:
        return PackedTTTContext(self.bounds)

    def count(self, in_draft: torch.Tensor) -> list[torch.Tensor]:
        """Set ``logit_rows``: per TTT step, the rows it counts given the target's argmax being in
        the draft vocabulary at each row (``in_draft`` [N], defined on ``teacher_rows``)."""
        self.logit_rows = []
        for s in range(self.ttt_steps):
            ok = self._same_sample(s + 2) & self._ahead(self.supervised, s + 2) & self._ahead(in_draft, s + 1)
            self.logit_rows.append(torch.nonzero(ok).flatten())
        return self.logit_rows
