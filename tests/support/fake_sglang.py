"""A stand-in for the few ``sglang`` 0.5.23 names ``SGLangCapture`` imports, with the same
call signatures (keyword names read in the 0.5.23 source) and a miniature model whose decoder
loop and logits-processor call follow models/llama.py.

The capture itself runs on SGLang's real ``ModelRunner`` in ``tests/integration/sglang/test_sglang_capture_real.py``;
this stand-in stays only for what a CPU cannot show: a second tensor-parallel rank's published
placement, a page size SGLang resolves on GPUs (64 for trtllm_mla), a pool capped by GPU memory,
flags ``ServerArgs`` switches on by itself there, a Kimi-K2.5 config, and pools freed after a
failed forward.
"""

import sys
import types
from array import array
from enum import Enum, IntEnum

import torch
from torch import nn

from eagle3_assets.engines.sglang.versions import SGLANG_VERSION

CALLS: list = []


class ServerArgs:
    RESOLVED: dict = {}  # what __post_init__ settles by itself (page_size for the backend, flags it turns on)

    def __init__(self, *, model_path, tp_size, dtype, trust_remote_code, max_total_tokens, max_running_requests,
                 skip_tokenizer_init, log_level, enable_return_hidden_states, disable_radix_cache,
                 chunked_prefill_size, disable_cuda_graph, pp_size, mem_fraction_static=None, ep_size=1,
                 page_size=None, enable_dp_attention=False, enable_attn_tp_input_scattered=False,
                 enable_two_batch_overlap=False):
        self.__dict__.update({k: v for k, v in locals().items() if k != "self"})
        self.__dict__.update(ServerArgs.RESOLVED)
        self.page_size = self.page_size or 1
        CALLS.append(("ServerArgs", dict(self.__dict__)))


class ModelConfig:
    @staticmethod
    def from_server_args(server_args, model_path=None, model_revision=None, is_draft_model=False, **kwargs):
        return ModelConfig()


class LogitsProcessor(nn.Module):
    def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None,
                hidden_states_before_norm=None):
        return types.SimpleNamespace(next_token_logits=hidden_states[-1:] @ lm_head.weight.T)


class TinyDecoder(nn.Module):
    def __init__(self, vocab=50, hidden=8, layers=6):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g) * 0.3
        self.layers_to_capture = []

    def forward(self, input_ids):
        h, aux = self.embed_tokens(input_ids), []
        for i, layer in enumerate(self.layers):
            if i in self.layers_to_capture:
                aux.append(h)
            h = h + torch.tanh(layer(h))
        return h / h.norm(dim=-1, keepdim=True), aux  # the "post-norm" final state


class TinyForCausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = TinyDecoder()
        self.lm_head = nn.Linear(8, 50, bias=False)
        self.logits_processor = LogitsProcessor()

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.model.layers_to_capture = [i + 1 for i in layer_ids]

    def forward(self, input_ids, positions, forward_batch):
        hidden, aux = self.model(input_ids)
        return self.logits_processor(input_ids, hidden, self.lm_head, forward_batch, aux)


class Pool:
    def __init__(self):
        self.device, self.cleared = torch.device("cpu"), 0

    def clear(self):
        self.cleared += 1


class ModelRunner:
    GPU_TOKENS = 1 << 20  # the KV pool the "GPU memory" leaves room for

    def __init__(self, model_config, mem_fraction_static, gpu_id, nccl_port, server_args, is_draft_worker=False,
                 req_to_token_pool=None, token_to_kv_pool_allocator=None, memory_pool_config=None,
                 draft_model_idx=None, draft_attention_backend=None, load_group=None):
        published, role, ranks = PUBLISHED
        if published is not server_args or role != "scheduler":  # SGLang's assert_published
            raise RuntimeError("config not published for role 'scheduler'")
        self.server_args, self.model_config, self.model = server_args, model_config, TinyForCausalLM()
        self.req_to_token_pool, self.token_to_kv_pool_allocator = Pool(), Pool()
        self.setup: list[str] = []
        self.fail_next = False
        self.page_size = server_args.page_size
        self.max_total_num_tokens = None
        CALLS.append(("ModelRunner", {"world_rank": ranks.world_rank, "gpu_id": gpu_id, "parallel": PARALLEL[:]}))

    def alloc_memory_pool(self, memory_pool_config=None):
        self.setup.append("alloc_memory_pool")
        wanted = min(self.server_args.max_total_tokens, ModelRunner.GPU_TOKENS)
        self.max_total_num_tokens = wanted // self.page_size * self.page_size  # floored to pages, as SGLang does

    def init_attention_backends(self):
        self.setup.append("init_attention_backends")

    def init_cuda_graphs(self, capture_decode_cuda_graph=True):
        self.setup.append("init_cuda_graphs")

    def forward(self, forward_batch, skip_attn_backend_init=None, pp_proxy_tensors=None, reinit_attn_backend=False,
                split_forward_count=1):
        if self.fail_next:
            raise RuntimeError("out of memory")
        assert forward_batch.capture_hidden_mode == CaptureHiddenMode.FULL
        out = self.model(forward_batch.input_ids, None, forward_batch)
        return types.SimpleNamespace(logits_output=out, can_run_graph=False)


class SamplingParams:
    def __init__(self, max_new_tokens=128, stop=None, stop_token_ids=None, stop_regex=None, temperature=1.0,
                 top_p=1.0, top_k=-1, min_p=0.0, **rest):
        self.max_new_tokens, self.temperature = max_new_tokens, temperature


class Req:
    def __init__(self, rid, origin_input_text, origin_input_ids, sampling_params, return_logprob=False, **rest):
        assert isinstance(origin_input_ids, array)
        self.rid, self.origin_input_ids, self.sampling_params = rid, origin_input_ids, sampling_params
        self.output_ids, self.full_untruncated_fill_ids, self.extend_end = array("q"), array("q"), None

    def init_next_round_input(self, tree_cache=None, cow_mamba=None):
        self.full_untruncated_fill_ids = self.origin_input_ids + self.output_ids
        self.extend_input_len = len(self.full_untruncated_fill_ids)


class ScheduleBatch:
    @classmethod
    def init_new(cls, reqs, req_to_token_pool, token_to_kv_pool_allocator, tree_cache, model_config, enable_overlap,
                 spec_algorithm, chunked_req=None, dllm_config=None):
        b = cls()
        b.reqs, b.device, b.capture_hidden_mode, b.input_ids = reqs, torch.device("cpu"), None, None
        return b

    def prepare_for_extend(self):
        ids = [t for r in self.reqs for t in r.full_untruncated_fill_ids[: r.extend_end]]
        self.prefill_input_ids_cpu = torch.tensor(ids, dtype=torch.int64)


class ForwardBatch:
    @classmethod
    def init_new(cls, batch, model_runner, *, capture_hidden_mode=None, return_hidden_states_before_norm):
        assert capture_hidden_mode == batch.capture_hidden_mode
        fb = cls()
        fb.capture_hidden_mode, batch.capture_hidden_mode = batch.capture_hidden_mode, None
        fb.input_ids = batch.input_ids
        return fb


class CaptureHiddenMode(IntEnum):
    NULL = 0
    LAST = 1
    FULL = 2


class SpeculativeAlgorithm(Enum):
    NONE = 0


class CacheInitParams:
    def __init__(self, disable, req_to_token_pool, token_to_kv_pool_allocator, page_size, is_eagle=False, **rest):
        self.disable = disable


class RadixCache:
    def __init__(self, params):
        assert params.disable
        self.params = params


PUBLISHED: list = [None, None, None]  # server_args, role, ranks
PARALLEL: list = []  # what bootstrap was asked to build, in order


class SpawnRanks:
    def __init__(self, world_rank, dp_rank=None, gpu_id=None):
        self.world_rank, self.dp_rank, self.gpu_id = world_rank, dp_rank, gpu_id


def publish(server_args, *, role, hf_config=None, ranks=None):
    PUBLISHED[:] = [server_args, role, ranks]


def get_device():
    return types.SimpleNamespace(device="cpu", gpu_id=PUBLISHED[2].gpu_id)


def init_parallel_runtime(*, server_args, device, dist_port):
    assert PUBLISHED[0] is server_args
    PARALLEL.append("init_parallel_runtime")


def init_layer_runtime(*, model_config):
    PARALLEL.append("init_layer_runtime")


MODULES = {
    "sglang": {"__version__": SGLANG_VERSION},
    "sglang.srt": {},
    "sglang.srt.configs": {},
    "sglang.srt.configs.model_config": {"ModelConfig": ModelConfig},
    "sglang.srt.layers": {},
    "sglang.srt.layers.logits_processor": {"LogitsProcessor": LogitsProcessor},
    "sglang.srt.model_executor": {},
    "sglang.srt.model_executor.model_runner": {"ModelRunner": ModelRunner},
    "sglang.srt.model_executor.forward_batch_info": {"CaptureHiddenMode": CaptureHiddenMode, "ForwardBatch": ForwardBatch},
    "sglang.srt.server_args": {"ServerArgs": ServerArgs},
    "sglang.srt.managers": {},
    "sglang.srt.managers.schedule_batch": {"Req": Req, "ScheduleBatch": ScheduleBatch},
    "sglang.srt.mem_cache": {},
    "sglang.srt.mem_cache.cache_init_params": {"CacheInitParams": CacheInitParams},
    "sglang.srt.mem_cache.radix_cache": {"RadixCache": RadixCache},
    "sglang.srt.runtime_context": {"SpawnRanks": SpawnRanks, "get_device": get_device, "publish": publish},
    "sglang.srt.distributed": {},
    "sglang.srt.distributed.bootstrap": {"init_parallel_runtime": init_parallel_runtime,
                                         "init_layer_runtime": init_layer_runtime},
    "sglang.srt.sampling": {},
    "sglang.srt.sampling.sampling_params": {"SamplingParams": SamplingParams},
    "sglang.srt.speculative": {},
    "sglang.srt.speculative.spec_info": {"SpeculativeAlgorithm": SpeculativeAlgorithm},
}


def install(monkeypatch) -> None:
    """Put the stand-in modules in ``sys.modules`` for one test."""
    CALLS.clear()
    PARALLEL.clear()
    PUBLISHED[:] = [None, None, None]
    monkeypatch.setattr(ServerArgs, "RESOLVED", {})
    monkeypatch.setattr(ModelRunner, "GPU_TOKENS", 1 << 20)
    for name, attrs in MODULES.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
