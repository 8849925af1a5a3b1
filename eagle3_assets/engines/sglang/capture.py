"""EAGLE-3 features from SGLang's own model code: a ``ModelRunner`` per tensor-parallel rank.

This is the only module that imports ``sglang`` in-process (the version the project supports is
``engines.sglang.versions.SGLANG_VERSION``, 0.5.23; the signatures below are 0.5.23's and run on its real
``ModelRunner``). Per rank it publishes SGLang's process configuration (``publish`` with the
rank's ``SpawnRanks``, as SGLang's scheduler entry does), builds the parallel runtime, then SGLang's
``ModelRunner`` for the target (radix cache off, chunked prefill off, CUDA graphs off: a
prefill-only pass over exact ids), asks the model for the aux layers through
``set_eagle3_layers_to_capture``, and replaces every ``LogitsProcessor`` with
:class:`CaptureHead`, which hands back the aux states and the final post-norm states of
every token instead of computing logits. A batch is a hand-built ``ScheduleBatch`` of
``Req`` objects in extend mode with ``CaptureHiddenMode.FULL``; every rank runs the same
forward (the tensor-parallel collectives need them all) and gets the same full-width states.

Run for real on this CPU (one rank, SmolLM2, SGLang's CPU engine): states equal to the local
extractor's token for token (``tests/integration/sglang/test_sglang_capture_real.py``). What only a GPU or several
ranks can show is tested with stand-ins (``tests/support/fake_sglang.py``) and listed in ``UNVERIFIED``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from eagle3_assets.engines.sglang.versions import SGLANG_VERSION  # noqa: F401  (recorded in manifests)

# Server settings a capture cannot work without; a user's server_args may not change them.
REQUIRED_SERVER_ARGS = {
    "enable_return_hidden_states": True,
    "disable_radix_cache": True,  # every token computed, none reused from a prefix cache
    "chunked_prefill_size": -1,  # one extend pass per request, states returned whole
    "disable_cuda_graph": True,  # graphs cover decode; capture is prefill only
    "pp_size": 1,  # the last pipeline stage alone sees the final states
}

# Server args SGLang accepts that break a capture, each with the reason (0.5.23 names, checked on its ServerArgs). Refused when
# given, and checked again on the resolved ServerArgs, which switch some on by themselves.
BREAKS_CAPTURE = {
    "enable_dp_attention": "data-parallel attention gives each attention rank its own share of the batch's requests "
                           "(SpecForge needs prepare_mlp_sync_batch_raw to run it), so no rank captures the whole batch",
    "enable_attn_tp_input_scattered": "it scatters a prefill's tokens over the tensor-parallel ranks, so each rank "
                                      "holds only a slice of every captured state",
    "enable_two_batch_overlap": "two-batch overlap runs a batch as two micro-batches whose later layers skip the "
                                "capture",
}


class CapturePoolError(ValueError):
    """A row or batch the capture's KV pool cannot hold; raised before any batch runs."""


def paged(tokens: int, page_size: int) -> int:
    """Tokens ``tokens`` take in a paged KV pool: whole pages (SGLang allocates per request)."""
    page = max(1, int(page_size))
    return -(-int(tokens) // page) * page


def kv_pool_tokens(longest_row: int, batch_tokens: int, page_size: int = 1) -> int:
    """SGLang's ``max_total_tokens`` for a capture: the most one batch can hold at once. Batches
    are planned in whole pages (``plan_batches(page_size=)``) within ``batch_tokens``, except that a
    row longer than that runs alone; the pool is the larger of the two, in whole pages."""
    return paged(max(int(batch_tokens), paged(longest_row, page_size)), page_size)


def breaking_args(args) -> list[str]:
    """The :data:`BREAKS_CAPTURE` settings that are on in ``args`` (a dict or a ServerArgs)."""
    get = args.get if isinstance(args, dict) else (lambda k: getattr(args, k, None))
    return [k for k in BREAKS_CAPTURE if get(k)]


def refuse_breaking(args, where: str) -> None:
    bad = breaking_args(args)
    if bad:
        reasons = "; ".join(f"{k}: {BREAKS_CAPTURE[k]}" for k in bad)
        raise ValueError(f"{where} turn on what breaks a hidden-state capture ({reasons}); leave them off")

# What the SGLang path relies on that has not run here (one CPU rank, a Llama target, SGLang's CPU engine).
UNVERIFIED = [
    "With torch.distributed already initialised by torchrun (env://, world == tp_size), "
    "bootstrap.init_parallel_runtime builds SGLang's world and TP groups on top of it instead of opening its own "
    "tcp:// rendezvous on nccl_port (SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE=env:// may be needed).",
    "Under plain tensor parallelism (no DP attention) hidden_states and the aux states are replicated full-width on "
    "every rank, so rank 0's copy is the whole answer.",
    "ServerArgs resolves page_size (64 where DeepSeek/Kimi pick trtllm_mla on sm100, 1 for fa3 on H200); after "
    "alloc_memory_pool, runner.max_total_num_tokens is the pool actually allocated (capped by GPU memory, floored "
    "to pages). On the CPU the page is 1 and the pool is the one planned.",
    "layers_to_capture indices mean 'the residual stream entering layer i' in the MLA models too (deepseek_v2.py's "
    "setter applies its +1 only when ids[0] == 1; set_capture_layers forces [k + 1 for k in ids]). Shown for Llama.",
]


def capture_server_args(model_path: str, *, tp_size: int, max_tokens: int, max_rows: int, dtype: str = "auto",
                        trust_remote_code: bool = False, extra: dict | None = None) -> dict:
    """``ServerArgs`` keywords for a prefill-only capture of exact ids on ``tp_size`` GPUs.

    The KV pool holds one batch (``max_tokens``, see :func:`kv_pool_tokens`) and ``max_rows``
    requests: the pass keeps nothing between batches, so the rest of the memory goes to weights
    and activations.
    """
    extra = dict(extra or {})
    refuse_breaking(extra, "server_args")
    clash = sorted(k for k in extra if k in REQUIRED_SERVER_ARGS and extra[k] != REQUIRED_SERVER_ARGS[k])
    if clash:
        raise ValueError(f"server_args {clash} would break the capture; they are fixed to "
                         f"{ {k: REQUIRED_SERVER_ARGS[k] for k in clash} }")
    args = {
        "model_path": model_path,
        "tp_size": int(tp_size),
        "dtype": dtype,
        "trust_remote_code": trust_remote_code,
        "max_total_tokens": int(max_tokens),
        "max_running_requests": int(max_rows),
        "skip_tokenizer_init": True,  # ids in, nothing to detokenize
        "log_level": "error",
        **REQUIRED_SERVER_ARGS,
    }
    args.update(extra)
    return args


@dataclass
class CapturedStates:
    """What :class:`CaptureHead` returns in place of logits, for every token of the batch."""

    aux: torch.Tensor  # [N, n_aux * H], the aux layers concatenated in capture order
    last: torch.Tensor  # [N, H], the final post-norm states (the lm_head input)
    next_token_logits: None = None  # the field SGLang's output type carries; never computed here


class CaptureHead(nn.Module):
    """Stands where the model's ``LogitsProcessor`` was: keeps the states, skips the lm_head."""

    def __init__(self, replaced: nn.Module):
        super().__init__()
        self.replaced = replaced  # kept so the module tree (and weight names) stay as loaded

    def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None, *args, **kwargs):
        if not aux_hidden_states:
            raise RuntimeError("the target returned no aux hidden states: set_eagle3_layers_to_capture did not take")
        return CapturedStates(aux=torch.cat(list(aux_hidden_states), dim=-1), last=hidden_states)


def replace_logits_processors(model: nn.Module, processor_type: type) -> int:
    """Swap every ``processor_type`` submodule of ``model`` for a :class:`CaptureHead`."""
    names = [name for name, m in model.named_modules() if isinstance(m, processor_type)]
    if not names:
        raise RuntimeError(f"{type(model).__name__} has no {processor_type.__name__} to replace")
    for name in names:
        if not name:
            raise RuntimeError("the model itself is a logits processor")
        parent, _, child = name.rpartition(".")
        holder = model.get_submodule(parent) if parent else model
        setattr(holder, child, CaptureHead(getattr(holder, child)))
    return len(names)


def set_capture_layers(model: nn.Module, layer_ids: Sequence[int]) -> list[int]:
    """Capture the outputs of decoder layers ``layer_ids`` (this project's ids, SpecForge's).

    Calls the model's ``set_eagle3_layers_to_capture`` (which switches the capture on), then
    makes the decoder's ``layers_to_capture`` (indices of the layers whose *input* is kept)
    exactly ``[k + 1 for k in layer_ids]``: SGLang's setters disagree on the +1 between
    model families, and a silent one-layer shift trains a drafter on the wrong states.
    """
    setter = getattr(model, "set_eagle3_layers_to_capture", None)
    if not callable(setter):
        raise RuntimeError(f"{type(model).__name__} has no set_eagle3_layers_to_capture: SGLang cannot capture "
                           "EAGLE-3 states for this architecture")
    setter(list(layer_ids))
    holders = [m for _, m in model.named_modules() if isinstance(getattr(m, "layers_to_capture", None), list)]
    if len(holders) != 1:
        raise RuntimeError(f"expected one decoder with layers_to_capture in {type(model).__name__}, found {len(holders)}")
    wanted = [int(k) + 1 for k in layer_ids]
    holders[0].layers_to_capture = wanted
    return wanted


class SGLangCapture:
    """One tensor-parallel rank's SGLang model, capturing ``(aux, last)`` for batches of ids.

    Build it on every rank of a torchrun job whose process group is already initialised
    (see :mod:`eagle3_assets.hidden_states.tensor_parallel`) and call :meth:`capture` with
    the same rows on every rank.
    """

    def __init__(self, model_path: str, *, layer_ids: Sequence[int], tp_rank: int, tp_size: int, gpu_id: int,
                 batch_tokens: int, longest_row: int, max_rows: int, dtype: str = "auto",
                 trust_remote_code: bool = False, server_args: dict | None = None, nccl_port: int = 0):
        import sglang
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.distributed import bootstrap
        from sglang.srt.layers.logits_processor import LogitsProcessor
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.runtime_context import SpawnRanks, get_device, publish
        from sglang.srt.server_args import ServerArgs

        from eagle3_assets.engines.sglang.versions import require_supported_sglang
        from eagle3_assets.engines.versions import check_version

        require_supported_sglang(sglang.__version__, "the capture's environment")

        args = ServerArgs(**capture_server_args(model_path, tp_size=tp_size, max_tokens=batch_tokens,
                                                max_rows=max_rows, dtype=dtype, trust_remote_code=trust_remote_code,
                                                extra=server_args))
        refuse_breaking(args, "the resolved ServerArgs")  # SGLang turns some on by itself (e.g. prefill CP)
        self.page_size = int(args.page_size or 1)  # resolved: 64 for trtllm_mla (Blackwell, DeepSeek/Kimi)
        self.pool_tokens = kv_pool_tokens(longest_row, batch_tokens, self.page_size)
        fixed = (server_args or {}).get("max_total_tokens")
        if fixed is not None and fixed < self.pool_tokens:
            raise CapturePoolError(f"server_args max_total_tokens {fixed} cannot hold the longest row ({longest_row} "
                                   f"tokens in pages of {self.page_size}) or a batch of {batch_tokens} tokens: "
                                   f"it needs {self.pool_tokens}")
        args.max_total_tokens = max(self.pool_tokens, fixed or 0)
        model_config = ModelConfig.from_server_args(args)
        hf_config = getattr(model_config, "hf_config", None)
        check_version("sglang", sglang.__version__, "eagle3", hf_config.to_dict() if hf_config is not None else {})
        # 0.5.23: ranks and settings come from the configuration the process entry publishes (as
        # SGLang's scheduler does), not from the runner's arguments.
        publish(args, role="scheduler", ranks=SpawnRanks(world_rank=tp_rank, dp_rank=None, gpu_id=gpu_id))
        bootstrap.init_parallel_runtime(server_args=args, device=get_device().device, dist_port=nccl_port)
        bootstrap.init_layer_runtime(model_config=model_config)
        self.runner = ModelRunner(model_config=model_config, mem_fraction_static=args.mem_fraction_static,
                                  gpu_id=gpu_id, nccl_port=nccl_port, server_args=args)
        self.runner.alloc_memory_pool()
        allocated = int(getattr(self.runner, "max_total_num_tokens", args.max_total_tokens))
        if allocated < self.pool_tokens:  # SGLang caps the pool at what the GPUs' memory leaves
            raise CapturePoolError(f"SGLang's KV pool holds {allocated} tokens, but the longest row ({longest_row} "
                                   f"tokens in pages of {self.page_size}) or a batch of {batch_tokens} needs "
                                   f"{self.pool_tokens}: raise mem_fraction_static, lower batch_tokens, or use more GPUs")
        self.runner.init_attention_backends()
        self.runner.init_cuda_graphs()
        self.layers_to_capture = set_capture_layers(self.runner.model, layer_ids)
        replace_logits_processors(self.runner.model, LogitsProcessor)

    def __call__(self, rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.capture(rows)

    @torch.no_grad()
    def capture(self, rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill ``rows`` exactly; (aux [sum T, 3H], last [sum T, H]) packed in row order."""
        from array import array

        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        runner = self.runner
        reqs = []
        for i, row in enumerate(rows):
            req = Req(rid=f"capture-{i}", origin_input_text="", origin_input_ids=array("q", row),
                      sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0))
            req.init_next_round_input(None)
            req.extend_end = len(row)  # no prefix: the whole row is extended in this pass
            reqs.append(req)
        cache = RadixCache(CacheInitParams(disable=True, req_to_token_pool=runner.req_to_token_pool,
                                           token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
                                           page_size=runner.page_size))
        try:
            batch = ScheduleBatch.init_new(reqs=reqs, req_to_token_pool=runner.req_to_token_pool,
                                           token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
                                           tree_cache=cache, model_config=runner.model_config, enable_overlap=False,
                                           spec_algorithm=SpeculativeAlgorithm.NONE)
            batch.prepare_for_extend()
            if getattr(batch, "prefill_input_ids_cpu", None) is not None:  # staged on the CPU until the forward
                batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
                batch.prefill_input_ids_cpu = None
            batch.capture_hidden_mode = CaptureHiddenMode.FULL
            fb = ForwardBatch.init_new(batch, runner, capture_hidden_mode=CaptureHiddenMode.FULL,
                                       return_hidden_states_before_norm=False)
            out = runner.forward(fb).logits_output
            if not isinstance(out, CapturedStates):
                raise RuntimeError(f"SGLang's forward returned {type(out).__name__}, not the captured states")
            return out.aux, out.last
        finally:
            runner.req_to_token_pool.clear()
            runner.token_to_kv_pool_allocator.clear()
