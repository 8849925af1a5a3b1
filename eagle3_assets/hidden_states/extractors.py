"""Extraction backends: the exact token ids in, per-sample EAGLE-3 features out.

Every backend implements ``extract(rows) -> list[Features]`` (one ``Features`` per row, in
order: ``aux`` [T, 3H] = the aux layers concatenated in id order, ``last`` [T, H] = the final
post-norm state) and ``describe() -> {"target": ..., "layers": ...}`` for the manifest.

- ``LocalExtractor``: transformers, in-process (CPU or one GPU), the embedded default.
- SGLang on GPU boxes runs as a ``torchrun`` job, one process per tensor-parallel rank
  (:mod:`~eagle3_assets.hidden_states.sglang_extract`); its packed ``(aux, last)`` captures
  come back to per-row ``Features`` through :func:`features_from_packed` here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from eagle3_assets.target import layers as hidden_layers
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
        """``device``/``dtype`` load ``model_dir`` (``auto`` for either: cuda and bfloat16 where a GPU
        is visible, else cpu and float32); a ``model`` passed in is used where and as it is."""
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
            mask = _to_device((torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long(), self.device)
        ids = _to_device(ids, self.device)
        captured: dict[int, torch.Tensor] = {}

        def hook_for(k):
            def hook(_module, _args, output):
                captured[k] = output[0] if isinstance(output, tuple) else output
            return hook

        layers = self._decoder_layers()
        handles = [layers[k].register_forward_hook(hook_for(k)) for k in self.layer_ids]
        try:
            with torch.inference_mode():
                out = self.base(input_ids=ids, attention_mask=mask, use_cache=False)
                last = out.last_hidden_state
                aux = torch.cat([captured[k] for k in self.layer_ids], dim=-1)
        finally:
            for h in handles:
                h.remove()
        return [Features(aux[i, :n], last[i, :n]) for i, n in enumerate(lengths)]


def _to_device(x, device):
    """A host tensor on ``device``; to a GPU from pinned memory without blocking this thread (a plain
    copy would wait for the device to finish the work queued before it: the last batch)."""
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


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


# ---- packed captures ----------------------------------------------------------------------------

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
