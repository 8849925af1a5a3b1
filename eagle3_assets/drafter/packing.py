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

    def groups(self) -> list[tuple[int, int, int]]:
        """(start, samples, length) of each run of consecutive samples of one length: a run is one
        batched attention call instead of one call per sample."""
        out: list[tuple[int, int, int]] = []
        for a, b in self.bounds:
            if out and out[-1][2] == b - a and out[-1][0] + out[-1][1] * out[-1][2] == a:
                out[-1] = (out[-1][0], out[-1][1] + 1, b - a)
            else:
                out.append((a, 1, b - a))
        return out

    def attend(self, q, k, v, scale: float) -> torch.Tensor:
        steps, out = self.push(k, v), []
        h = q.shape[1]

        def runs(x, a, count, n):  # [1, h, count * n, d] -> [count, h, n, d] (a view)
            return x[:, :, a:a + count * n].reshape(1, h, count, n, x.shape[-1]).transpose(1, 2)[0]

        for a, count, n in self.groups():
            qs = runs(q, a, count, n)
            if steps == 1:
                o = F.scaled_dot_product_attention(qs, runs(k, a, count, n), runs(v, a, count, n), is_causal=True,
                                                   scale=scale)
            else:
                ks = torch.cat([runs(kk, a, count, n) for kk in self.keys], dim=2)
                vs = torch.cat([runs(vv, a, count, n) for vv in self.values], dim=2)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=self._mask(n, steps, q.device), scale=scale)
            out.append(o.transpose(0, 1).reshape(1, h, count * n, o.shape[-1]))
        return torch.cat(out, dim=2)


class PackedBatch:
    """The real tokens of a right-padded batch as one row, with what the drafter and loss need.

    Which rows are real, supervised or read by the teacher follows from the masks alone, so it is
    worked out on the host (``host_attention_mask`` / ``host_loss_mask`` when the trainer kept
    them, else the masks themselves) and moved over: on a GPU no step waits for the device to
    learn the batch's layout. The ``*_host`` copies stay for the id cache and ``count``."""

    def __init__(self, batch: dict, ttt_steps: int):
        device = batch["attention_mask"].device
        valid = batch.get("host_attention_mask", batch["attention_mask"]).cpu().bool()
        loss_mask = batch.get("host_loss_mask", batch["loss_mask"]).cpu()
        lengths = valid.sum(-1).tolist()
        ends = torch.tensor(lengths).cumsum(0).tolist()
        self.bounds = [(e - n, e) for n, e in zip(lengths, ends) if n > 0]
        self.n = int(sum(lengths))
        flat = torch.nonzero(valid.flatten()).flatten()  # the real positions of [B, T], row by row
        self.sample_host = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))  # [N]
        starts = torch.tensor([e - n for n, e in zip(lengths, ends)], dtype=torch.long)
        positions = torch.arange(self.n) - starts[self.sample_host]
        self.supervised_host = loss_mask.flatten()[flat] > 0  # [N]
        self.ttt_steps = ttt_steps
        self.teacher_rows_host = torch.nonzero(self._same_sample(1, self.sample_host)
                                               & self._ahead(self.supervised_host, 1)).flatten()
        to = dict(device=device, non_blocking=True)
        flat, self.sample = flat.to(**to), self.sample_host.to(**to)
        self.positions = positions.to(**to)[None]  # [1, N]
        self.supervised = self.supervised_host.to(**to)
        self.teacher_rows = self.teacher_rows_host.to(**to)
        self.input_ids = batch["input_ids"].reshape(-1).index_select(0, flat)[None]
        self.aux_hidden = batch["aux_hidden"].reshape(-1, batch["aux_hidden"].shape[-1]).index_select(0, flat)[None]
        self.last_hidden = batch["last_hidden"].reshape(-1, batch["last_hidden"].shape[-1]).index_select(0, flat)  # [N, H]
        self.logit_rows: list[torch.Tensor] = []

    @staticmethod
    def _ahead(x: torch.Tensor, n: int, fill=False) -> torch.Tensor:
        """x[r + n] at row r (``fill`` past the end); a sample boundary is the caller's to check."""
        if n >= x.shape[0]:
            return torch.full_like(x, fill)
        return torch.cat([x[n:], x.new_full((n, *x.shape[1:]), fill)])

    def _same_sample(self, n: int, sample: torch.Tensor | None = None) -> torch.Tensor:
        sample = self.sample if sample is None else sample
        return self._ahead(sample, n, fill=-1) == sample

    def shift(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        """[1, N] ids: the token n ahead in the same sample, 0 past its end (``shift_left`` per sample)."""
        return torch.where(self._same_sample(n), self._ahead(ids[0], n, fill=0), 0)[None]

    def context(self) -> PackedTTTContext:
        return PackedTTTContext(self.bounds)

    def count(self, in_draft: torch.Tensor) -> list[torch.Tensor]:
        """Set ``logit_rows``: per TTT step, the rows it counts given the target's argmax being in
        the draft vocabulary at each row (``in_draft`` [N], defined on ``teacher_rows``). An
        ``in_draft`` on the host is counted there (no wait on the device)."""
        host = in_draft.device.type == "cpu"
        sample, supervised = (self.sample_host, self.supervised_host) if host else (self.sample, self.supervised)
        self.logit_rows = []
        for s in range(self.ttt_steps):
            ok = self._same_sample(s + 2, sample) & self._ahead(supervised, s + 2) & self._ahead(in_draft, s + 1)
            rows = torch.nonzero(ok).flatten()
            self.logit_rows.append(rows.to(self.sample.device, non_blocking=True) if host else rows)
        return self.logit_rows

    def count_chains(self) -> list[torch.Tensor]:
        """Set ``logit_rows`` for scoring draft chains: per TTT step s, the rows r whose drafts
        r + 2 .. r + 2 + s all lie on supervised tokens of r's sample (nested: each step's rows are
        among the step before's). Unlike ``count``, a target token outside the draft vocabulary
        keeps its row: there it is a draft the target rejects, as in serving."""
        ok = torch.ones(self.n, dtype=torch.bool)
        self.logit_rows = []
        for s in range(self.ttt_steps):
            ok &= self._same_sample(s + 2, self.sample_host) & self._ahead(self.supervised_host, s + 2)
            self.logit_rows.append(torch.nonzero(ok).flatten().to(self.sample.device, non_blocking=True))
        return self.logit_rows
