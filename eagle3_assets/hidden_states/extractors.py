"""Extraction backends: the exact token ids in, per-sample EAGLE-3 features out.

Every backend implements ``extract(rows) -> list[Features]`` (one ``Features`` per row, in
order: ``aux`` [T, 3H] = the aux layers concatenated in id order, ``last`` [T, H] = the final
post-norm state) and ``describe() -> {"target": ..., "layers": ...}`` for the manifest.

- ``LocalExtractor``: transformers, in-process (CPU or one GPU), the embedded default.
- ``SGLangExtractor``: SGLang on GPU boxes, behind lazy imports. sglang cannot be installed
  here, so only its pure parts (requests, row splitting, validation) are tested; what remains
  unproven is listed in ``UNVERIFIED``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from eagle3_assets.hidden_states import layers as hidden_layers
from eagle3_assets.target.identity import target_identity

N_AUX = hidden_layers.N_AUX


@dataclass
class Features:
    aux: object  # torch.Tensor [T, n_aux * H]
    last: object  # torch.Tensor [T, H]


def check_rows(rows: Sequence[Sequence[int]], *, vocab_size: int | None = None, max_len: int | None = None) -> None:
    """Reject what a prefill cannot take, naming the row: empty, too long, ids out of vocab."""
    for i, row in enumerate(rows):
        if len(row) == 0:
            raise ValueError(f"row {i} is empty: a prefill needs at least one token")
        if max_len is not None and len(row) > max_len:
            raise ValueError(f"row {i} has {len(row)} tokens, over the target's limit of {max_len}")
        if vocab_size is not None:
            lo, hi = min(row), max(row)
            if lo < 0 or hi >= vocab_size:
                raise ValueError(f"row {i} holds token ids in [{lo}, {hi}], outside the vocab 0..{vocab_size - 1}")


# ---- transformers ---------------------------------------------------------------------------

class LocalExtractor:
    """EAGLE-3 features from a transformers causal LM, without ever computing the lm_head.

    Runs the *base* model (``model.model``) on right-padded batches with an attention mask;
    forward hooks on the chosen decoder layers keep just those three outputs, and the base
    model's ``last_hidden_state`` is already the post-norm final state. Hooks were chosen over
    ``output_hidden_states=True``: that keeps all L+1 states of the batch alive (31 for
    SmolLM2) for the same compute, and its last entry's meaning changed in transformers 5
    (post-norm), while a hook's meaning does not depend on the transformers version.
    Right padding keeps every real token at its true position, so padded rows produce the
    same states as unpadded ones (up to kernel rounding; see the round-trip test).
    """

    def __init__(
        self,
        model_dir: Path | str | None = None,
        *,
        model=None,
        layer_ids: list[int] | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        target: dict | None = None,
    ):
        if model is None:
            if model_dir is None:
                raise ValueError("LocalExtractor needs model_dir or a loaded model")
            from eagle3_assets.target.loading import load_causal_lm

            model = load_causal_lm(model_dir, dtype=dtype, device=device)
        self.model = model
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self._target = target
        self.base = getattr(model, "model", model)
        self.config = model.config
        self.device = next(model.parameters()).device
        self.hidden_size = int(self.config.hidden_size)
        self.num_layers = hidden_layers.num_layers(self.config)
        self.layer_ids = hidden_layers.resolve_layer_ids(self.config, layer_ids)
        self.vocab_size = int(self.config.vocab_size)
        pad = getattr(self.config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0

    def describe(self) -> dict:
        target = self._target
        if target is None:
            target = target_identity(self.model_dir) if self.model_dir is not None else {
                "name": getattr(self.config, "name_or_path", "") or "in-memory model", "id": None}
        return {"target": target,
                "layers": hidden_layers.convention(self.layer_ids, self.num_layers),
                "backend": "transformers"}

    def _decoder_layers(self):
        layers = getattr(self.base, "layers", None)
        if layers is None:
            raise TypeError(f"{type(self.base).__name__} has no .layers: not a decoder-only HF model")
        return layers

    def extract(self, rows: Sequence[Sequence[int]]) -> list[Features]:
        import torch

        check_rows(rows, vocab_size=self.vocab_size)
        lengths = [len(r) for r in rows]
        width = max(lengths)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
        mask = None
        if min(lengths) != width:
            mask = (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
            mask = mask.to(self.device)
        captured: dict[int, torch.Tensor] = {}

        def hook_for(k):
            def hook(_module, _args, output):
                captured[k] = output[0] if isinstance(output, tuple) else output
            return hook

        layers = self._decoder_layers()
        handles = [layers[k].register_forward_hook(hook_for(k)) for k in self.layer_ids]
        try:
            with torch.inference_mode():
                out = self.base(input_ids=ids.to(self.device), attention_mask=mask, use_cache=False)
                last = out.last_hidden_state
                aux = torch.cat([captured[k] for k in self.layer_ids], dim=-1)
        finally:
            for h in handles:
                h.remove()
        return [Features(aux[i, :n], last[i, :n]) for i, n in enumerate(lengths)]


def forward_only(model, rows: Sequence[Sequence[int]], pad_id: int = 0) -> None:
    """The bare base-model forward on the same padded batch, no capture (benchmark baseline)."""
    import torch

    lengths = [len(r) for r in rows]
    width = max(lengths)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    mask = None
    if min(lengths) != width:
        mask = (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    base = getattr(model, "model", model)
    device = next(model.parameters()).device
    with torch.inference_mode():
        base(input_ids=ids.to(device), attention_mask=None if mask is None else mask.to(device), use_cache=False)


# ---- SGLang ---------------------------------------------------------------------------------

# Statements the SGLang path relies on that could not be run here (no sglang, no GPU).
UNVERIFIED = [
    "sglang.Engine(**engine_kwargs(...)) accepts enable_return_hidden_states, disable_radix_cache, "
    "chunked_prefill_size=-1, disable_cuda_graph and skip_tokenizer_init together (reference A4).",
    "Engine.generate(input_ids=[[...]], sampling_params=[...], return_hidden_states=True, rid=[...]) "
    "prefills exactly the given ids (no BOS added, no truncation) and returns one dict per request, "
    "in request order, with meta_info['hidden_states'] (reference A4).",
    "With max_new_tokens=1 the first entry of meta_info['hidden_states'] covers every prompt token "
    "(CaptureHiddenMode.FULL), one row per token, as nested lists or a tensor.",
    "Stock SGLang has no request-level switch for aux layers (reference A5): the engine path only "
    "yields aux+last when the scheduler-side model was patched to store cat(aux layers, post-norm "
    "final) per token (width 4H); widths 3H (aux only, stock EAGLE-3 capture) and H (final only) "
    "are refused with an explanation.",
    "model.set_eagle3_layers_to_capture(ids) captures the residual entering layer id+1, i.e. the "
    "output of layer id, for explicit ids (reference A5); sglang PR #25454 applies the +1 only when "
    "the first id is 1, which holds for the default [1, L//2-1, L-4] but not for arbitrary ids.",
    "The 'specforge' backend: specforge.offline_capture.sglang_backend.capture."
    "OfflineSGLangCaptureBackend.build(model_path, torch_dtype=..., trust_remote_code=..., **server_args), "
    ".set_eagle3_capture_layers(ids) and .capture_rows(rows) -> (aux_rows, last_rows) in row order "
    "(SpecForge source read, pinned to sglang 0.5.14, never executed here).",
    "Radix cache off and chunked prefill off are needed so every token of every request is computed "
    "in one extend pass and returned (no prefix reuse, no split prefill).",
]


def engine_kwargs(
    model_path: str,
    *,
    tp_size: int = 1,
    dtype: str = "auto",
    mem_fraction_static: float = 0.4,
    trust_remote_code: bool = False,
    **extra,
) -> dict:
    """``sglang.Engine`` arguments for a prefill-only capture of exact ids."""
    kwargs = {
        "model_path": model_path,
        "tp_size": tp_size,
        "dtype": dtype,
        "trust_remote_code": trust_remote_code,
        "enable_return_hidden_states": True,
        "disable_radix_cache": True,  # every token computed, none reused from a prefix cache
        "chunked_prefill_size": -1,  # one extend pass per request, states returned whole
        "disable_cuda_graph": True,  # cuda graphs cover decode; capture is prefill only
        "skip_tokenizer_init": True,  # ids in, nothing to detokenize
        "mem_fraction_static": mem_fraction_static,
        "log_level": "error",
    }
    kwargs.update(extra)
    return kwargs


def build_requests(rows: Sequence[Sequence[int]], rids: Sequence[str] | None = None) -> dict:
    """One batched ``Engine.generate`` call prefilling ``rows`` exactly, one token decoded."""
    check_rows(rows)
    if rids is not None and len(rids) != len(rows):
        raise ValueError(f"{len(rids)} request ids for {len(rows)} rows")
    req = {
        "input_ids": [[int(t) for t in r] for r in rows],
        "sampling_params": [{"max_new_tokens": 1, "temperature": 0.0} for _ in rows],
        "return_hidden_states": True,
    }
    if rids is not None:
        if len(set(rids)) != len(rids):
            raise ValueError("request ids must be unique")
        req["rid"] = [str(r) for r in rids]
    return req


def split_packed(packed, lengths: Sequence[int]) -> list:
    """Split a tensor packed along the token axis into per-row tensors, checking the total."""
    if any(n <= 0 for n in lengths):
        raise ValueError(f"every row length must be positive, got {list(lengths)}")
    total = sum(lengths)
    if packed.shape[0] != total:
        raise ValueError(f"packed states hold {packed.shape[0]} tokens but the rows add up to {total}")
    return list(packed.split(list(lengths), dim=0))


def check_features(feats: Sequence[Features], lengths: Sequence[int], hidden_size: int, n_aux: int = N_AUX) -> None:
    """Per row: aux [T, n_aux*H] and last [T, H] with T the row's length."""
    if len(feats) != len(lengths):
        raise ValueError(f"{len(feats)} results for {len(lengths)} rows")
    for i, (f, n) in enumerate(zip(feats, lengths)):
        if tuple(f.aux.shape) != (n, n_aux * hidden_size):
            raise ValueError(f"row {i}: aux states {tuple(f.aux.shape)}, expected ({n}, {n_aux * hidden_size})")
        if tuple(f.last.shape) != (n, hidden_size):
            raise ValueError(f"row {i}: final states {tuple(f.last.shape)}, expected ({n}, {hidden_size})")


def features_from_packed(aux_packed, last_packed, lengths: Sequence[int], hidden_size: int,
                         n_aux: int = N_AUX) -> list[Features]:
    feats = [Features(a, b) for a, b in zip(split_packed(aux_packed, lengths), split_packed(last_packed, lengths))]
    check_features(feats, lengths, hidden_size, n_aux)
    return feats


def features_from_engine_output(output: dict, n_tokens: int, hidden_size: int, n_aux: int = N_AUX) -> Features:
    """Features of one request from ``meta_info['hidden_states']`` laid out as cat(aux, last)."""
    import torch

    states = (output.get("meta_info") or {}).get("hidden_states")
    if not states:
        raise ValueError("the engine returned no hidden states: was it started with enable_return_hidden_states "
                         "and the request sent with return_hidden_states=True?")
    prefill = torch.as_tensor(states[0]) if not isinstance(states[0], torch.Tensor) else states[0]
    if prefill.dim() == 1:  # a single-token prompt may come back flat
        prefill = prefill.unsqueeze(0)
    if prefill.shape[0] < n_tokens:
        raise ValueError(f"the engine returned states for {prefill.shape[0]} of {n_tokens} prompt tokens "
                         "(radix cache or chunked prefill still on?)")
    prefill = prefill[:n_tokens]
    width = prefill.shape[1]
    full = (n_aux + 1) * hidden_size
    if width == full:
        return Features(prefill[:, : n_aux * hidden_size], prefill[:, n_aux * hidden_size:])
    if width == n_aux * hidden_size:
        raise ValueError("the engine returned the aux layers but not the final post-norm state; "
                         "its capture must store cat(aux, final) per token")
    if width == hidden_size:
        raise ValueError("the engine returned only the final state: aux-layer capture is not enabled "
                         "in the engine (stock SGLang has no request-level switch, see UNVERIFIED)")
    raise ValueError(f"hidden-state width {width} matches neither {full} (aux+final) nor "
                     f"{n_aux * hidden_size} or {hidden_size} for hidden size {hidden_size}")


class SGLangExtractor:
    """EAGLE-3 features from SGLang: prefill the exact ids, capture aux layers and the final state.

    ``backend`` picks how SGLang runs, all in-process (GPU boxes only):
    - ``"engine"``: ``sglang.Engine`` with radix cache and chunked prefill off, one batched
      ``generate`` per batch (``build_requests``), states parsed per request. Needs an engine
      whose capture returns cat(aux, final) per token (see ``UNVERIFIED``).
    - ``"specforge"``: SpecForge's offline capture boundary (``OfflineSGLangCaptureBackend``),
      which swaps the logits processor so one packed extend pass returns aux and final states
      without computing logits; rows are split back by length.
    - a callable ``rows -> (aux_packed [sum T, 3H], last_packed [sum T, H])``, for tests and
      for other capture patches.
    """

    def __init__(
        self,
        model_path: str,
        *,
        hidden_size: int,
        num_layers: int,
        layer_ids: list[int] | None = None,
        backend: str | Callable = "engine",
        vocab_size: int | None = None,
        target: dict | None = None,
        **server_args,
    ):
        self.model_path = model_path
        self.hidden_size = int(hidden_size)
        self.num_layers = int(num_layers)
        self.layer_ids = hidden_layers.resolve_layer_ids(self.num_layers, layer_ids)
        self.vocab_size = vocab_size
        self.backend = backend
        self.server_args = server_args
        self._target = target
        self._engine = None
        self._capture = backend if callable(backend) else None

    def describe(self) -> dict:
        target = self._target
        if target is None and (Path(self.model_path) / "config.json").exists():
            target = target_identity(self.model_path)
        return {"target": target or {"name": self.model_path, "id": None},
                "layers": hidden_layers.convention(self.layer_ids, self.num_layers),
                "backend": f"sglang-{self.backend if isinstance(self.backend, str) else 'custom'}"}

    def _start(self) -> None:
        if self._capture is not None or self._engine is not None:
            return
        if self.backend == "engine":
            import sglang  # noqa: PLC0415 - optional, GPU-only dependency

            self._engine = sglang.Engine(**engine_kwargs(self.model_path, **self.server_args))
        elif self.backend == "specforge":
            from specforge.offline_capture.sglang_backend.capture import OfflineSGLangCaptureBackend

            cap = OfflineSGLangCaptureBackend.build(self.model_path, **self.server_args)
            cap.set_eagle3_capture_layers(list(self.layer_ids))

            def capture(rows):
                import torch

                aux_rows, last_rows = cap.capture_rows([list(r) for r in rows])
                return torch.cat(list(aux_rows)), torch.cat(list(last_rows))

            self._capture = capture
        else:
            raise ValueError(f"unknown SGLang backend {self.backend!r}: 'engine', 'specforge' or a callable")

    def extract(self, rows: Sequence[Sequence[int]]) -> list[Features]:
        check_rows(rows, vocab_size=self.vocab_size)
        lengths = [len(r) for r in rows]
        self._start()
        if self._engine is not None:
            outs = self._engine.generate(**build_requests(rows))
            if isinstance(outs, dict):
                outs = [outs]
            if len(outs) != len(rows):
                raise ValueError(f"the engine answered {len(outs)} of {len(rows)} requests")
            feats = [features_from_engine_output(o, n, self.hidden_size) for o, n in zip(outs, lengths)]
            check_features(feats, lengths, self.hidden_size)
            return feats
        aux, last = self._capture(rows)
        return features_from_packed(aux, last, lengths, self.hidden_size)

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
