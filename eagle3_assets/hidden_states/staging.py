"""One batch's features -> storage bytes on the host, without stalling the device that made them.

A whole batch is packed along the token axis, counted for non-finite values and converted to the
storage dtype on its own device, then copied to the host with one asynchronous copy per tensor
into pinned memory (a CPU batch is host memory already). Nothing here waits for the device: the
extraction loop calls :meth:`StagedBatch.wait` one batch later, while the next forward runs, and
the shard writer reads the rows as views of the host buffers (no copy per row).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StagedBatch:
    lengths: list[int]
    offsets: list[int]  # row starts along the token axis, and the total
    host: dict  # aux_hidden [N, 3H], last_hidden [N, H] (+ aux_scale, last_scale [N] in fp8), storage dtypes
    bad: object  # [2, N] int32: non-finite values per token in aux, in last (counted before conversion)
    event: object | None = None  # the device's copy event; None when the tensors were made on the host

    def wait(self) -> None:
        """Block until the host buffers hold the batch (the copy enqueued by :func:`stage`)."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None

    def nonfinite(self) -> list[tuple[int, int]]:
        """Per row: (non-finite aux values, non-finite final values)."""
        import numpy as np

        self.wait()
        sums = np.add.reduceat(self.bad.numpy(), np.asarray(self.offsets[:-1]), axis=1) if self.lengths else []
        return [(int(a), int(b)) for a, b in zip(sums[0], sums[1])] if len(self.lengths) else []

    def row(self, i: int) -> dict:
        """Row ``i``'s storage tensors: views of the batch's host buffers."""
        self.wait()
        a, b = self.offsets[i], self.offsets[i + 1]
        return {k: v[a:b] for k, v in self.host.items()}


def stage(feats, dtype: str) -> StagedBatch:
    """Pack, count and convert ``feats`` on their device; start the copy to the host; return at once."""
    import torch

    from eagle3_assets.hidden_states.encoding import quantize_fp8

    lengths = [int(f.aux.shape[0]) for f in feats]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    if not feats:
        return StagedBatch(lengths, offsets, {}, torch.zeros((2, 0), dtype=torch.int32))
    with torch.no_grad():
        aux = torch.cat([f.aux.detach() for f in feats])
        last = torch.cat([f.last.detach() for f in feats])
        bad = torch.stack([(~torch.isfinite(aux)).sum(-1, dtype=torch.int32),
                           (~torch.isfinite(last)).sum(-1, dtype=torch.int32)])
        if dtype == "bf16":
            packed = {"aux_hidden": aux.to(torch.bfloat16), "last_hidden": last.to(torch.bfloat16)}
        else:
            (qa, sa), (ql, sl) = quantize_fp8(aux), quantize_fp8(last)
            packed = {"aux_hidden": qa, "last_hidden": ql, "aux_scale": sa, "last_scale": sl}
        device = aux.device
        if device.type == "cpu":
            # a copy of the model's outputs in every case (cat), so the batch owns its memory
            return StagedBatch(lengths, offsets, {k: v.contiguous() for k, v in packed.items()}, bad)
        if device.type != "cuda":  # another accelerator: a plain (synchronous) copy
            return StagedBatch(lengths, offsets, {k: v.cpu() for k, v in packed.items()}, bad.cpu())
        host = {}
        for k, v in [*packed.items(), ("bad", bad)]:
            host[k] = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
            host[k].copy_(v, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    bad_host = host.pop("bad")
    return StagedBatch(lengths, offsets, host, bad_host, event)
