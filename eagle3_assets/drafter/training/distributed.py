"""Process-group helpers: one process, or ``torchrun`` with gloo (CPU) or nccl (GPU)."""

from __future__ import annotations

import os
import random
import socket

import torch


def dist_info() -> tuple[int, int]:
    """(rank, world size); (0, 1) without a process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    if dist_info()[1] > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def gather_lists(items: list) -> list:
    """Every rank's ``items`` joined, in rank order, on every rank (``items`` itself alone)."""
    import torch.distributed as dist

    if dist_info()[1] <= 1:
        return list(items)
    gathered: list = [None] * dist_info()[1]
    dist.all_gather_object(gathered, list(items))
    return [x for part in gathered for x in part]


def barrier() -> None:
    import torch.distributed as dist

    if dist_info()[1] > 1:
        dist.barrier()


def init_distributed(device: str = "auto") -> torch.device:
    """Join the process group ``torchrun`` describes (if any) and pick this rank's device."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and device in ("auto", "cuda")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
        # one line per rank in the job's output: which node each rank landed on
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        print(f"eagle3: rank {dist.get_rank()}/{world} on {node} (local rank {local})", flush=True)
    if device not in ("auto", "cuda"):
        return torch.device(device)
    if cuda:
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def close_distributed() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
