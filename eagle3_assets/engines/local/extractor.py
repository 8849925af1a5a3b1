"""The ``local`` engine's extractor: transformers in this process (CPU or one GPU), the embedded default.

It keeps the extract role's ``Extractor`` protocol (:mod:`eagle3_assets.engines.roles`):
``extract(rows) -> list[Features]`` (one per row, in order: ``aux`` [T, 3H] = the aux layers
concatenated in id order, ``last`` [T, H] = the final post-norm state) and ``describe()`` for the manifest.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from eagle3_assets.engines.roles import Features, check_rows
from eagle3_assets.target import layers as hidden_layers
from eagle3_assets.target.identity import target_identity

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
