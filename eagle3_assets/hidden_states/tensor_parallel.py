"""Extraction across the ranks of one tensor-parallel group: every rank runs the forward,
rank 0 decides what to run and writes the shards.

Rank 0 drives :func:`~eagle3_assets.hidden_states.extract.extract_corpus` unchanged (resume,
batching, quarantine, shards, index, manifest are the local extractor's) through a
:class:`LeaderExtractor`, which broadcasts each batch of rows over a small gloo group before
running its own share of the forward; the other ranks sit in :func:`follow`, running the
same forward on the same rows, until the leader says stop. A ``capture`` is any callable
``rows -> (aux [sum T, 3H], last [sum T, H])`` that must run on all ranks together:
:class:`~eagle3_assets.engines.sglang.capture.SGLangCapture` on GPU boxes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from eagle3_assets.engines.roles import Features, check_rows, features_from_packed

Capture = Callable[[Sequence[Sequence[int]]], tuple]


@dataclass
class Group:
    rank: int
    world_size: int
    local_rank: int
    control: object  # a gloo process group for the row broadcasts (None alone)


def init_tensor_parallel(tp_size: int, *, backend: str | None = None) -> Group:
    """Join the torchrun job (``WORLD_SIZE`` must equal ``tp_size``: one tensor-parallel
    group per job) and open the gloo group the rows travel on."""
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp_size:
        raise ValueError(f"this job runs {world} processes but tensor parallelism is {tp_size}: launch it with "
                         f"torchrun --nproc-per-node={tp_size}")
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
    if "MASTER_ADDR" not in os.environ:  # not launched by torchrun: one process, nothing to join
        return Group(0, 1, local, None)
    if not dist.is_initialized():
        # Joined here, on torchrun's store: SGLang's ModelRunner then finds the group initialised and
        # builds its own groups on top instead of opening a second store on MASTER_PORT.
        dist.init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"))
    return Group(rank, world, local, dist.new_group(backend="gloo") if world > 1 else None)


def _broadcast(group: Group, message: list) -> list:
    import torch.distributed as dist

    box = [message]
    dist.broadcast_object_list(box, src=0, group=group.control)
    return box[0]


class LeaderExtractor:
    """Rank 0's extractor: the rows go to every rank, then this rank's capture runs."""

    def __init__(self, capture: Capture, group: Group, *, hidden_size: int, describe: dict,
                 vocab_size: int | None = None, max_rows: int | None = None, max_length: int | None = None,
                 page_size: int = 1):
        self.capture, self.group = capture, group
        self.hidden_size, self.vocab_size, self.max_rows = int(hidden_size), vocab_size, max_rows
        self.max_length, self.page_size = max_length, int(page_size)  # what extract_corpus plans batches with
        self._describe = describe
        self.forwards = 0

    def describe(self) -> dict:
        return self._describe

    def extract(self, rows: Sequence[Sequence[int]]) -> list[Features]:
        check_rows(rows, vocab_size=self.vocab_size)
        rows = [[int(t) for t in r] for r in rows]
        if self.group.world_size > 1:
            _broadcast(self.group, ["rows", rows])
        aux, last = self.capture(rows)
        self.forwards += 1
        return features_from_packed(aux.cpu(), last.cpu(), [len(r) for r in rows], self.hidden_size)

    def stop(self) -> None:
        """Release the followers (also after a failure, so no rank waits forever)."""
        if self.group.world_size > 1:
            _broadcast(self.group, ["stop", None])


def follow(capture: Capture, group: Group) -> int:
    """A non-zero rank: run the leader's batches until it stops; returns the forwards run."""
    n = 0
    while True:
        kind, rows = _broadcast(group, [None, None])
        if kind == "stop":
            return n
        capture(rows)
        n += 1
