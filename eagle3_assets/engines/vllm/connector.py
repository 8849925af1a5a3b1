"""vLLM's hidden-state connector made to run on the CPU build (loaded *inside* the vLLM server).

vLLM's ``ExampleHiddenStatesConnector`` copies each finished request's rows out of the cache into
pinned host memory on a CUDA stream and marks the copy with a CUDA event. On the CPU build the
first write kills the worker (``pin_memory=True requires a CUDA or other accelerator backend``),
and the CPU stand-in for CUDA events has no ``query()``. On CPU the cache already is host memory:
this subclass copies the request's rows with a plain ``clone()`` (the blocks are freed right after)
and hands the writer thread an event that is already complete. The file layout, the lock protocol
(``<file>.lock`` held exclusively until the file is written) and everything scheduler-side are the
stock connector's.

Loaded with ``--kv-transfer-config '{"kv_connector": "CpuHiddenStatesConnector",
"kv_connector_module_path": "eagle3_assets.engines.vllm.connector", ...}'``; the server's
``PYTHONPATH`` must reach this package (``VLLMServer`` sets it). This module imports only vLLM and
torch: it runs in vLLM's environment, not the project's.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Completed:
    """Stands in for the CUDA event that marks a device-to-host copy: on CPU there is none."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


COMPLETED = _Completed()


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` without CUDA streams, events or pinned memory."""

    def _slots(self, block_ids: list[int]) -> torch.Tensor:
        blocks = torch.tensor(block_ids, dtype=torch.long).unsqueeze(1)
        return (blocks * self._block_size + torch.arange(self._block_size, dtype=torch.long)).flatten()

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        if self._kv_cache is None:
            raise RuntimeError("hidden-state cache not registered")
        rows = extract_from_kv_cache(self._kv_cache, self._slots(pending.block_ids), pending.token_ids.shape[0])
        tensors = {"hidden_states": rows.clone(), "token_ids": pending.token_ids.clone()}
        if self._req_futures.get(pending.req_id) is not None:
            raise RuntimeError(f"request {pending.req_id} is already being written")
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        future = self._executor.submit(self._write_tensors, tensors, COMPLETED, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = COMPLETED
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
