"""How a training step is laid out in memory: micro-batches, recomputation, loss chunks.

``StepMemory`` is what the trainer runs with; ``split_batch`` cuts a rank's batch into
micro-batches of at most ``micro_batch_tokens`` real tokens (consecutive samples, each cut to
its own longest row), so a batch of long agentic replies never holds more tokens at once than
the plan allows, whatever its sequence count.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class StepMemory:
    """The trainer's memory layout; the defaults are the plain step (one pass, nothing recomputed)."""

    micro_batch_tokens: int = 0  # 0: the rank's whole batch in one forward and backward
    checkpoint: bool = False  # recompute each TTT step's layer in backward
    loss_chunk_rows: int = 0  # 0: the head and softmaxes over all counted rows at once

    def to_dict(self) -> dict:
        return asdict(self)


def split_batch(batch: dict, micro_batch_tokens: int) -> list[dict]:
    """``batch`` (right-padded, on the host) as micro-batches of consecutive samples holding at
    most ``micro_batch_tokens`` real tokens each (a longer sample goes alone); one part when 0."""
    if micro_batch_tokens <= 0:
        return [batch]
    lengths = batch["attention_mask"].sum(-1).tolist()
    groups, current, held = [], [], 0
    for i, n in enumerate(lengths):
        if current and held + n > micro_batch_tokens:
            groups.append(current)
            current, held = [], 0
        current.append(i)
        held += n
    if current:
        groups.append(current)
    if len(groups) == 1:
        return [batch]
    parts = []
    for rows in groups:
        a, b = rows[0], rows[-1] + 1
        width = max(1, max(lengths[a:b]))
        part = {k: v[a:b, :width] for k, v in batch.items() if torch.is_tensor(v)}
        if "keys" in batch:
            part["keys"] = batch["keys"][a:b]
        parts.append(part)
    return parts


# ----------------------------------------------------------------------------- the estimate
#
# Bytes autograd keeps for backward, per real token and TTT step, read off the step's code
# (drafter/model.py, drafter/kinds/mla/memory.py, drafter/contexts.py, drafter/packing.py, training/loss.py).
# ``c`` is the compute dtype's size (4: float32; 2: bf16 autocast, where each linear keeps a bf16
# copy of its input and each RMSNorm a float32 copy of its own); ``s`` is the TTT step.


def _kind_memory(cfg):
    """The drafter kind's own attention terms (``DrafterKind.memory``), or None: Llama's GQA terms below."""
    from eagle3_assets.drafter.kinds import get_kind

    return get_kind(cfg.attention).memory


def attention_kernel(cfg, device_type: str) -> str:
    """Which SDPA kernel PyTorch picks for the drafter's attention: "math" (the scores kept per
    head: a CPU with MLA's unequal q/k and v head sizes, which its flash kernel refuses) or
    "fused" (flash on CPU; memory-efficient or cuDNN on a GPU: the scores never stored)."""
    memory = _kind_memory(cfg)
    return memory.kernel(cfg, device_type) if memory is not None else "fused"


def _attention_bytes(cfg, s: int, c: int, kernel: str) -> int:
    """What one step's attention keeps per token, linear in tokens: queries, the keys and values
    of steps 0..s side by side, the output (per sample, and re-laid for o_proj), softmax
    statistics, and under bf16 autocast each projection's own copy of the 2H input; the math
    kernel keeps scaled copies of q and k instead (its scores are in ``_sample_square_bytes``)."""
    memory = _kind_memory(cfg)
    if memory is not None:
        return memory.step_bytes(cfg, s, c, kernel)
    heads = cfg.num_attention_heads
    q = heads * cfg.head_dim
    inputs = 3 * 2 * cfg.hidden_size * 2 if c == 2 else 0  # q, k and v each keep their own bf16 copy of the 2H input
    return (2 * s + 5) * q * c + heads * 4 + 2 * cfg.head_dim * c + inputs


def _sample_square_bytes(cfg, s: int, kernel: str) -> int:
    """Per (token x sample length) of one step, for each sample: the math kernel's float32
    scores (heads x (s+1) keys); the fused kernels keep none."""
    return cfg.num_attention_heads * (s + 1) * 4 if kernel == "math" else 0


def _call_square_bytes(s: int, c: int, kernel: str) -> int:
    """Per (token x sample length) of one step, for each attention call: the fused kernels'
    additive mask made from the boolean TTT mask ((s+1) keys, steps >= 1). Samples of one
    length side by side are one call (``PackedTTTContext.groups``), so they share it."""
    return (s + 1) * c if s and kernel != "math" else 0


def _mask_cache_bytes(s: int) -> int:
    """The boolean TTT mask of step s per (token x sample length), cached while the step runs."""
    return s + 1 if s else 0


def _layer_bytes(cfg, s: int, c: int, kernel: str = "fused", e: int = 4) -> int:
    """One TTT step's decoder layer per token: the three norms' outputs (in their input's dtype;
    the embedding's is ``e`` bytes), the float32 inputs and rsqrt of the two norms on the hidden
    stream (the frozen embedding's norm keeps neither: nothing of it needs a gradient), the 2H
    concatenation (fp32; under bf16 autocast each projection reading it keeps its own copy,
    counted as the attention's), the MLP's input (bf16: the gate's and the up projection's
    copies) and its 4 I-wide tensors."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    hidden = 8 * h * c if c == 4 else 2 * h * 4 + (e + 2 + 2) * h + 2 * h * 2
    return hidden + 4 * i * c + 2 * 4 + _attention_bytes(cfg, s, c, kernel)


def _kept_keys_bytes(cfg, c: int) -> int:
    """Under recomputation, what each step keeps for the later steps' attention: its keys and
    values (for MLA, the kv_b output the values view)."""
    memory = _kind_memory(cfg)
    if memory is not None:
        return memory.kept_keys_bytes(cfg, c)
    return 2 * cfg.num_attention_heads * cfg.head_dim * c


ALPHA_LOSSES = ("tv", "nla", "lk")  # read alpha = sum min(p, q), which keeps q = exp(log q) for backward


def _loss_row_bytes(cfg, c: int, chunked: bool, loss: str = "kl") -> int:
    """Per counted row and step: the int64 index that gathers it; then the row's norm (its float32
    input, the rsqrt, its output), the head's input, and the float32 [N] blocks: the draft
    log-softmax and the teacher's probabilities, and for ``tv``, ``nla`` and ``lk`` the draft
    probabilities alpha reads, with alpha itself. Chunked, the gathered row and the chunk's
    index into the teacher's rows, which its recomputation reads."""
    h, n = cfg.hidden_size, cfg.draft_vocab_size
    if chunked:
        return 8 + h * c + 8
    alpha = loss in ALPHA_LOSSES
    norm = 3 * h * 4 if c == 4 else h * (2 + 4 + 2)
    return 8 + norm + 4 + (3 if alpha else 2) * n * 4 + (8 if alpha else 0)


def _square(lengths) -> int:
    return sum(n * n for n in lengths)


@dataclass(frozen=True)
class BatchShape:
    """What the estimate needs of a micro-batch: its real tokens and the longest sample; with its
    lengths known (``of``), the squares its masks and scores take. Left out, each is the most it
    can be: every sample as long as the longest and of its own length (so no two share a mask)."""

    tokens: int
    longest: int
    counted_share: float = 1.0  # rows a TTT step counts / tokens (loss mask x draft vocabulary)
    square: int | None = None  # sum of squared sample lengths (None: tokens x longest, the most it can be)
    calls_square: int | None = None  # the same over attention calls: a run of equal lengths is one call
    lengths_square: int | None = None  # the same over distinct lengths: the TTT masks are cached per length

    @classmethod
    def of(cls, lengths: list[int], counted_share: float = 1.0) -> BatchShape:
        """The shape of a batch of samples of ``lengths`` in batch order (as the packed batch lays them)."""
        runs = [n for k, n in enumerate(lengths) if n and (k == 0 or lengths[k - 1] != n)]
        return cls(sum(lengths), max(lengths, default=0), counted_share, _square(lengths), _square(runs),
                   _square(set(lengths)))

    @property
    def sum_sq(self) -> int:
        return self.tokens * self.longest if self.square is None else self.square

    @property
    def call_sq(self) -> int:
        return self.sum_sq if self.calls_square is None else self.calls_square

    @property
    def length_sq(self) -> int:
        return self.sum_sq if self.lengths_square is None else self.lengths_square


def activation_bytes(cfg, batch: BatchShape, ttt_steps: int, c: int, memory: StepMemory,
                     kernel: str = "fused", e: int = 4, loss: str = "kl") -> dict[str, int]:
    """Bytes held through one micro-batch's backward, by part: ``saved`` (autograd's saved
    tensors at the end of the forward), ``mask_cache`` (the boolean TTT masks, alive meanwhile),
    ``recompute`` (one step's layer rebuilt in backward, under checkpointing) and ``loss_chunk``
    (one chunk's float32 blocks). ``loss``: the recipe's objective (``tv``, ``nla`` and ``lk``
    keep one more float32 block a row than ``kl``)."""
    t, rows = batch.tokens, batch.tokens * batch.counted_share
    h = cfg.hidden_size
    fc_in = 3 * cfg.target_hidden_size * c
    chunked = memory.loss_chunk_rows > 0
    held = sum(rows * _loss_row_bytes(cfg, c, chunked, loss) for _ in range(ttt_steps))

    def squares(s: int) -> int:
        return batch.sum_sq * _sample_square_bytes(cfg, s, kernel) + batch.call_sq * _call_square_bytes(s, c, kernel)

    if memory.checkpoint:
        layer = t * ttt_steps * (h * c + _kept_keys_bytes(cfg, c))
        recompute = max(t * _layer_bytes(cfg, s, c, kernel, e) + squares(s) for s in range(ttt_steps))
        masks = 0
    else:
        layer = t * sum(_layer_bytes(cfg, s, c, kernel, e) for s in range(ttt_steps))
        masks = sum(squares(s) for s in range(ttt_steps))
        recompute = 0
    mask_cache = batch.length_sq * sum(_mask_cache_bytes(s) for s in range(ttt_steps))
    chunk = 0
    if chunked:
        chunk = min(memory.loss_chunk_rows, int(rows)) * (_loss_row_bytes(cfg, c, False, loss) + 2 * cfg.draft_vocab_size * 4)
    return {"saved": int(t * fc_in + layer + held + masks), "mask_cache": int(mask_cache), "recompute": int(recompute),
            "loss_chunk": int(chunk)}


# ----------------------------------------------------------------------------- the step's peak

GiB = 1 << 30
LOSS_CHUNK_ROWS = 4096  # the chunk the plan uses when the loss must be chunked: [4096, N] float32 blocks


def parameter_counts(cfg) -> tuple[int, int, int]:
    """(trainable, frozen embedding, fc) parameter counts of the drafter, from its shape alone."""
    from eagle3_assets.drafter.model import Eagle3Drafter

    with torch.device("meta"):
        model = Eagle3Drafter(cfg)
    trainable = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("embed_tokens."))
    return trainable, model.embed_tokens.weight.numel(), model.fc.weight.numel()


def autocast_weight_bytes(cfg) -> int:
    """The bf16 weight copies autocast makes and autograd keeps: every matrix whose input needs a
    gradient, so all but fc (it reads the target's features, which need none)."""
    trainable, _, fc = parameter_counts(cfg)
    return 2 * (trainable - fc)


@dataclass(frozen=True)
class MemoryEstimate:
    parts: dict  # name -> bytes
    memory: StepMemory
    capacity: int | None = None  # bytes the plan may use on the device (None: unknown)

    @property
    def peak(self) -> int:
        return sum(self.parts.values())

    def fits(self) -> bool:
        return self.capacity is None or self.peak <= self.capacity

    def describe(self) -> str:
        layout = (f"micro-batches of {self.memory.micro_batch_tokens:,} tokens" if self.memory.micro_batch_tokens
                  else "the whole batch at once")
        layout += f", loss in chunks of {self.memory.loss_chunk_rows:,} rows" if self.memory.loss_chunk_rows else ""
        layout += ", each TTT step recomputed in backward" if self.memory.checkpoint else ""
        cap = f" of {self.capacity / GiB:.1f} GiB usable" if self.capacity else ""
        return f"estimated peak {self.peak / GiB:.1f} GiB per device{cap} ({layout})"


def estimate_step(cfg, *, ttt_steps: int, rank_sequences: int, max_length: int, memory: StepMemory,
                  compute_bytes: int, device_type: str = "cuda", optimizer: str = "adamw", world_size: int = 1,
                  counted_share: float = 1.0, capacity: int | None = None, loss: str = "kl") -> MemoryEstimate:
    """The peak bytes one rank holds during a training step whose batch is ``rank_sequences``
    samples of ``max_length`` tokens (the worst case a batch of long replies can reach; their
    masks counted as if no two samples were of one length, which a batch of long but unequal
    replies reaches), under the recipe's ``loss``.

    Static: float32 master weights, their gradients and the optimizer's state (AdamW 2 per
    weight; Muon 1 on its matrices), DDP's gradient buckets, the frozen embedding, the teacher's
    full and draft heads in the compute dtype, its argmax block, and under bf16 autocast the bf16
    copies of the weights autograd keeps. Per micro-batch: the batch on the device, its packed
    copies, the teacher's draft logits, the activations (``activation_bytes``) and, for the
    backward, one more step's layer as its working set."""
    c = compute_bytes
    e = c  # the trainer holds the frozen embedding in the compute dtype
    trainable, embedding, _ = parameter_counts(cfg)
    h, n = cfg.hidden_size, cfg.draft_vocab_size
    state = 8 if optimizer == "adamw" else 6  # muon: momentum on most weights, AdamW pairs on the head and norms
    tokens = rank_sequences * max_length
    micro = memory.micro_batch_tokens or tokens
    shape = BatchShape(tokens=min(micro, tokens), longest=max_length, counted_share=counted_share)
    acts = activation_bytes(cfg, shape, ttt_steps, c, memory, attention_kernel(cfg, device_type), e, loss)
    kernel = attention_kernel(cfg, device_type)
    parts = {
        "weights": 4 * trainable, "gradients": 4 * trainable, "optimizer": state * trainable,
        "ddp_buckets": 4 * trainable if world_size > 1 else 0,
        "autocast_weights": autocast_weight_bytes(cfg) if c == 2 else 0,
        "embedding": e * embedding,
        "teacher_heads": c * (cfg.vocab_size + n) * h,
        "teacher_argmax_chunk": (1 << 28) * c if device_type == "cuda" else (1 << 26) * c,
        "batch": tokens * 4 * cfg.target_hidden_size * c,
        "packed_copies": min(micro, tokens) * 4 * cfg.target_hidden_size * c,
        "teacher_logits": int(min(micro, tokens) * counted_share * n * c),
        **{f"activations_{k}": v for k, v in acts.items()},
        "backward_workset": min(micro, tokens) * max(_layer_bytes(cfg, s, c, kernel, e) for s in range(ttt_steps)),
    }
    return MemoryEstimate(parts, memory, capacity)


def plan_step(cfg, *, capacity: int, ttt_steps: int, rank_sequences: int, max_length: int, compute_bytes: int,
              device_type: str = "cuda", optimizer: str = "adamw", world_size: int = 1,
              fixed: StepMemory | None = None, loss: str = "kl") -> MemoryEstimate:
    """The cheapest layout that fits ``capacity`` bytes: the whole batch; else the loss in
    chunks with the largest micro-batch (whole sequences) that fits; else the same with each
    TTT step recomputed. ``fixed`` (a layout the user set) is estimated as it is. The result
    may not fit: the caller refuses it, naming the settings."""
    kw = dict(ttt_steps=ttt_steps, rank_sequences=rank_sequences, max_length=max_length, compute_bytes=compute_bytes,
              device_type=device_type, optimizer=optimizer, world_size=world_size, capacity=capacity, loss=loss)
    if fixed is not None:
        return estimate_step(cfg, memory=fixed, **kw)
    whole = rank_sequences * max_length
    candidates = [StepMemory()]
    sizes = sorted({max_length * k for k in range(1, rank_sequences + 1)}, reverse=True)
    for checkpoint in (False, True):
        candidates += [StepMemory(0 if size >= whole else size, checkpoint, LOSS_CHUNK_ROWS) for size in sizes]
    last = None
    for memory in candidates:
        last = estimate_step(cfg, memory=memory, **kw)
        if last.fits():
            return last
    return last


def refusal(estimate: MemoryEstimate, *, max_length: int, batch_size: int, world_size: int, per_node: int) -> str:
    """What to change when even one sequence, recomputed, with the loss in chunks, does not fit.
    A rank holds its share of the batch (``batch_size`` / ``world_size`` sequences) on the device
    whatever the layout, so on few GPUs the batch is the part to cut, or to spread over more."""
    top = sorted(estimate.parts.items(), key=lambda kv: -kv[1])[:4]
    where = ", ".join(f"{k} {v / GiB:.1f} GiB" for k, v in top)
    nodes = max(1, world_size // max(1, per_node))
    share = max(1, batch_size // max(1, world_size))
    return (f"the training step does not fit: {estimate.describe()}; largest parts: {where}. "
            f"Lower 'batch_size' (now {batch_size:,}: {share:,} sequences on each of {world_size:,} GPUs, "
            f"{per_node:,} per node x {nodes:,} node(s)) or 'max_length' (now {max_length:,}) in the recipe; or train on more "
            "GPUs (the step's 'nproc_per_node', GPUs per node, or more nodes), each then holding fewer sequences; "
            "or lower 'draft_vocab_size' / 'intermediate_size'; or train on a device with more memory (runtime "
            "'memory_fraction' sets how much of it the plan may use)")


def device_capacity(device: torch.device) -> int | None:
    """Bytes of memory on a CUDA device (None elsewhere: a CPU's memory is shared with the rest)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)


def plan_for_run(cfg, training, runtime, device: torch.device, *, world_size: int, compute_bytes: int,
                 capacity: int | None = None) -> MemoryEstimate:
    """The layout a run trains with, from its settings (``TrainSettings``, ``RuntimeSettings``)
    and its device: what the user set, else on a GPU the plan's cheapest layout that fits, else
    (a CPU) the plain step. The estimate comes with it either way."""
    capacity = capacity if capacity is not None else device_capacity(device)
    usable = int(capacity * runtime.memory_fraction) if capacity else None
    auto = runtime.micro_batch_tokens < 0 and runtime.activation_checkpointing == "auto" and runtime.loss_chunk_rows < 0
    fixed = None
    if not auto or usable is None:
        fixed = StepMemory(micro_batch_tokens=max(0, runtime.micro_batch_tokens),
                           checkpoint=runtime.activation_checkpointing == "on", loss_chunk_rows=max(0, runtime.loss_chunk_rows))
    if fixed is not None and 0 < fixed.micro_batch_tokens < training.max_length:
        raise ValueError(f"micro_batch_tokens {fixed.micro_batch_tokens:,} is below max_length {training.max_length:,}: "
                         "a micro-batch holds whole samples")
    return plan_step(cfg, capacity=usable, ttt_steps=training.ttt_steps, max_length=training.max_length,
                     rank_sequences=max(1, training.batch_size // world_size), compute_bytes=compute_bytes,
                     device_type=device.type, optimizer=training.optimizer, world_size=world_size, fixed=fixed,
                     loss=training.loss)


def saved_tensor_bytes(fn, exclude: list[torch.Tensor] = ()) -> tuple[object, int]:
    """Run ``fn()`` and count the bytes of the storages autograd saves for backward while it runs
    (each storage once; those of ``exclude``, the weights, left out): the record the activation
    estimate is checked against. Returns (``fn``'s result, bytes)."""
    own = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())
