"""The project's side of the reference run (speculators 0.9): data out to it, its drafter back in.

Run with the project's environment (``.venv``); the trainer itself runs in ``.venv-speculators``
(``benchmarks/reference_speculators.py``). Two directions:

``to_speculators`` writes one split of a hidden-state dataset (shards + index + manifest, read
with :class:`ShardReader`) as speculators' offline data: one ``hs_<i>.safetensors`` per sample
under ``<out>/hidden_states`` with ``token_ids`` int64 [T] and ``hidden_states`` [T, 4, H]
(the three aux layers, then the verifier's last state), and ``rows.jsonl`` with each row's
``input_ids`` and ``loss_mask`` in the same order (the runner turns it into speculators' Arrow
dataset and token counts). Only the requested split is read; the eval split never leaves the
shards.

The last state differs in meaning: our shards hold the *post*-norm final state (the lm_head
input), speculators stores the last decoder layer's output *before* the final norm and applies
the verifier's norm itself. The converter re-runs the target over each row (transformers,
float32, one row at a time) and takes the input of its final norm; the aux layers are copied
from the shards unchanged. It reports how far the re-run lands from the stored data: the aux
layers recomputed against the stored ones, and the target's norm of the new pre-norm state
against the stored post-norm one (both bf16 rounding apart when the target is the one that
wrote the shards).

``to_project`` turns a trained speculators checkpoint (``config.json`` + ``model.safetensors``,
``layers.0.*``) into the project's drafter, refusing options our ``Eagle3Drafter`` does not
have (a norm before fc, normed residual or output, per-layer fc norms, more than one layer,
sliding-window attention), and writes its SGLang export, which the project's evaluators load.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

HS_DIR = "hidden_states"
ROWS = "rows.jsonl"
MANIFEST = "conversion.json"
UNREPRESENTED_FLAGS = ("norm_before_fc", "norm_before_residual", "norm_output", "fc_norm")


# ----------------------------------------------------------------------------- data: ours -> speculators


def hs_file(out_dir: Path, index: int) -> Path:
    """speculators' name for row ``index``'s hidden states (its FileTransfer reads this)."""
    return Path(out_dir) / HS_DIR / f"hs_{index}.safetensors"


class PreNormStates:
    """The target's last decoder-layer output before its final norm, and its aux layers, for one
    row at a time (float32, no padding)."""

    def __init__(self, target_dir: Path | str, aux_layer_ids: list[int]):
        from eagle3_assets.target.loading import load_causal_lm

        self.model = load_causal_lm(target_dir)
        self.norm = self.model.get_decoder().norm
        self.aux_layer_ids = list(aux_layer_ids)
        self._captured: list[torch.Tensor] = []
        self.norm.register_forward_pre_hook(lambda _m, args: self._captured.append(args[0]))

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [T, 3H], pre-norm last [T, H]) of the row ``ids`` [T], float32."""
        from eagle3_assets.drafter.spec_decode import aux_from_hidden_states

        self._captured.clear()
        out = self.model.get_decoder()(input_ids=ids[None].long(), output_hidden_states=True, use_cache=False)
        (pre,) = self._captured
        aux = aux_from_hidden_states(out.hidden_states, self.aux_layer_ids)
        return aux[0].float(), pre[0].float()

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.norm(x)


def to_speculators(hs_dir: Path | str, out_dir: Path | str, target_dir: Path | str, *, split: str = "train",
                   states=None, limit: int | None = None) -> dict:
    """Write the ``split`` rows of ``hs_dir`` as speculators' offline data under ``out_dir``;
    returns the conversion record (also written as ``conversion.json``). ``states`` computes
    (aux, pre-norm last) of a row (default: the target at ``target_dir``); ``limit`` keeps the
    first rows only (a smoke run)."""
    from safetensors.torch import save_file

    from eagle3_assets.hidden_states.reader import ShardReader
    from eagle3_assets.target.layers import to_speculators_ids

    if split == "eval":
        raise ValueError("the eval split is held out: it is never handed to the reference trainer")
    out_dir = Path(out_dir)
    (out_dir / HS_DIR).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    reader = ShardReader(hs_dir)
    layers = reader.manifest["layers"]
    if layers.get("final") != "post_norm":
        raise ValueError(f"{hs_dir}: final state is {layers.get('final')!r}; this converter expects post_norm shards")
    aux_ids = list(layers["aux_layer_ids"])
    states = states or PreNormStates(target_dir, aux_ids)
    ids = reader.sample_ids(split)[:limit]
    if not ids:
        raise ValueError(f"{hs_dir}: no {split} samples")
    h = reader.hidden_size
    worst = {"aux_max_abs": 0.0, "aux_max_rel": 0.0, "post_norm_max_abs": 0.0, "post_norm_max_rel": 0.0}
    tokens = 0
    with open(out_dir / ROWS, "w", encoding="utf-8") as rows:
        for i, s in enumerate(reader.iter_samples(ids)):
            if s.split != split:
                raise AssertionError(f"{s.sample_id} is in {s.split}, not {split}")
            aux_new, pre = states(s.input_ids)
            aux_old, post_old = s.aux_hidden.float(), s.last_hidden.float()
            post_new = states.final_norm(pre)
            for name, new, old in (("aux", aux_new, aux_old), ("post_norm", post_new, post_old)):
                diff = (new - old).abs().max().item()
                worst[f"{name}_max_abs"] = max(worst[f"{name}_max_abs"], diff)
                worst[f"{name}_max_rel"] = max(worst[f"{name}_max_rel"], diff / max(old.abs().max().item(), 1e-12))
            n = len(s)
            hidden = torch.cat([s.aux_hidden.reshape(n, 3, h), pre.to(s.aux_hidden.dtype).reshape(n, 1, h)], dim=1)
            save_file({"token_ids": s.input_ids.to(torch.int64).contiguous(), "hidden_states": hidden.contiguous()},
                      str(hs_file(out_dir, i)))
            rows.write(json.dumps({"index": i, "sample_id": s.sample_id, "input_ids": s.input_ids.tolist(),
                                   "loss_mask": s.loss_mask.tolist()}) + "\n")
            tokens += n
    record = {
        "source": str(Path(hs_dir).resolve()), "source_updated_at": reader.manifest.get("updated_at"),
        "split": split, "samples": len(ids), "tokens": tokens,
        "target": str(target_dir), "hidden_size": h, "dtype": str(hidden.dtype).removeprefix("torch."),
        "aux_layer_ids": aux_ids, "speculators_layer_ids": to_speculators_ids(aux_ids),
        "final": "pre_norm: the target's final-norm input, recomputed (float32, one row at a time)",
        "recomputed_vs_stored": worst, "seconds": round(time.perf_counter() - t0, 1),
    }
    (out_dir / MANIFEST).write_text(json.dumps(record, indent=2))
    return record


# ----------------------------------------------------------------------------- drafter: speculators -> ours


def layout_problems(config: dict) -> list[str]:
    """What in a speculators eagle3 config our ``Eagle3Drafter`` cannot represent."""
    problems = []
    if config.get("speculators_model_type") != "eagle3":
        problems.append(f"speculators_model_type is {config.get('speculators_model_type')!r}, not 'eagle3'")
    for flag in UNREPRESENTED_FLAGS:
        if config.get(flag, False):
            problems.append(f"{flag} is on: the SGLang-layout drafter has no such norm")
    layer = config.get("transformer_layer_config") or {}
    if layer.get("num_hidden_layers", 1) != 1:
        problems.append(f"{layer.get('num_hidden_layers')} decoder layers: this drafter has one")
    if "sliding_attention" in (layer.get("layer_types") or []) or layer.get("use_sliding_window"):
        problems.append("sliding-window attention: the engines' EAGLE-3 Llama layer attends to the whole context")
    if layer.get("model_type", "llama") != "llama":
        problems.append(f"draft layer {layer.get('model_type')!r}: this drafter is a Llama layer")
    return problems


def drafter_from_speculators(ckpt_dir: Path | str, target_dir: Path | str):
    """The project's ``Eagle3Drafter`` holding a speculators checkpoint's weights (target embeddings)."""
    from safetensors.torch import load_file

    from eagle3_assets.drafter.model import DrafterConfig, Eagle3Drafter
    from eagle3_assets.drafter.target_weights import read_target_embeddings

    ckpt_dir, target_dir = Path(ckpt_dir), Path(target_dir)
    config = json.loads((ckpt_dir / "config.json").read_text())
    problems = layout_problems(config)
    if problems:
        raise ValueError(f"{ckpt_dir}: " + "; ".join(problems))
    weights = load_file(str(ckpt_dir / "model.safetensors"))
    target = json.loads((target_dir / "config.json").read_text())
    cfg = DrafterConfig.from_target(
        target, draft_vocab_size=int(config["draft_vocab_size"]),
        aux_layer_ids=[i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]],  # vLLM's k = state after k layers
        intermediate_size=int(weights["layers.0.mlp.gate_proj.weight"].shape[0]),
    )
    layer = config.get("transformer_layer_config") or {}
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
        if key in layer and int(layer[key]) != int(getattr(cfg, key)):
            raise ValueError(f"{ckpt_dir}: {key} {layer[key]} differs from the target-shaped drafter's {getattr(cfg, key)}")
    state = {}
    for k, v in weights.items():
        if k.startswith("embed_tokens."):
            continue  # the target's own, frozen in both trainers
        name = "midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k
        state[name] = v if k in ("d2t", "t2d") else v.float()
    state["embed_tokens.weight"] = read_target_embeddings(target_dir).float()
    state["d2t"], state["t2d"] = state["d2t"].to(torch.int64), state["t2d"].to(torch.bool)
    model = Eagle3Drafter(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{ckpt_dir}: weights do not fit the drafter: missing {missing}, unexpected {unexpected}")
    return model.eval()


def to_project(ckpt_dir: Path | str, out_dir: Path | str, target_dir: Path | str) -> Path:
    """Write ``<out_dir>/sglang`` (the layout ``drafter.evaluate.load_export`` reads) from a
    speculators checkpoint."""
    from eagle3_assets.drafter import formats

    model = drafter_from_speculators(ckpt_dir, target_dir)
    path = formats.export("sglang", model, Path(out_dir) / "sglang", dtype="bfloat16")  # the checkpoint's own dtype
    problems = formats.check("sglang", path)
    if problems:
        raise ValueError(f"{path}: " + "; ".join(problems))
    return path


def draft_agreement(model, parity_file: Path | str) -> dict:
    """How often our rebuilt drafter drafts what speculators' own model drafted on the same rows
    (``parity.safetensors``, written by the runner): per TTT step, over every position."""
    from safetensors.torch import load_file

    data = load_file(str(parity_file))
    same, total = None, 0
    n = int(data["count"].item())
    for i in range(n):
        ids, aux = data[f"input_ids.{i}"].long(), data[f"aux.{i}"].float()
        steps = int(data[f"steps.{i}"].item())
        with torch.no_grad():
            logits = model(ids[None], aux[None], ttt_steps=steps)
        t = ids.shape[0] - 1  # speculators drops the first token of a row (its shifted batch)
        ours = torch.stack([lg[0, :t].argmax(-1) for lg in logits])
        theirs = data[f"draft_ids.{i}"].long()[:, :t]
        eq = (ours == theirs).sum(-1)
        same = eq if same is None else same + eq
        total += t
    rates = (same.float() / total).tolist()
    return {"rows": n, "positions": total, "per_step": [round(r, 5) for r in rates]}


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="data to speculators 0.9, its drafter back (project environment)")
    sub = ap.add_subparsers(dest="command", required=True)
    a = sub.add_parser("to-speculators", help="one split of a hidden-state dataset as speculators' offline data")
    a.add_argument("hs_dir", type=Path)
    a.add_argument("out_dir", type=Path)
    a.add_argument("--target", type=Path, required=True)
    a.add_argument("--split", default="train")
    a.add_argument("--limit", type=int, default=None)
    b = sub.add_parser("to-project", help="a speculators checkpoint as the project's SGLang export")
    b.add_argument("checkpoint", type=Path)
    b.add_argument("out_dir", type=Path)
    b.add_argument("--target", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.command == "to-speculators":
        print(json.dumps(to_speculators(args.hs_dir, args.out_dir, args.target, split=args.split, limit=args.limit)))
    else:
        print(to_project(args.checkpoint, args.out_dir, args.target))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
