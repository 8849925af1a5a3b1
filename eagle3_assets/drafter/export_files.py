"""The file-level pieces every drafter export shares (Llama and MLA layouts alike): the dtypes an
export may be written in, the weights as written, the atomic directory write, and rebuilding the
drafter from weights read back. Each serving format (``drafter/formats``) builds on these, so no
format imports another's internals."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from eagle3_assets.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3_assets.files import disk_full_names, require_free

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def write_dir_atomic(out_dir: Path, files: dict[str, object]) -> Path:
    """Write every file into a temporary sibling, then swap it into place, so a reader never
    sees a half-written export. ``files`` maps names to a JSON-able dict or a tensor dict. The free
    space is checked for every tensor first; a disk that fills meanwhile fails naming the file, and
    the export already there stays as it was."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    need = sum(v.numel() * v.element_size() for payload in files.values() for v in payload.values()
               if isinstance(v, torch.Tensor))
    require_free(out_dir.parent, need, f"the export {out_dir.name}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        for name, payload in files.items():
            with disk_full_names(out_dir / name):
                if name.endswith(".json"):
                    (tmp / name).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
                else:
                    save_file({k: v.contiguous() for k, v in payload.items()}, str(tmp / name), metadata={"format": "pt"})
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        if out_dir.exists():
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def export_weights(model: Eagle3Drafter, dtype: torch.dtype, rename=lambda k: k, embeddings: bool = False) -> dict:
    out = {}
    for k, v in model.state_dict().items():
        if k.startswith("embed_tokens.") and not embeddings:
            continue
        v = v.detach().cpu()
        if k not in ("d2t", "t2d"):
            v = v.to(dtype)
        out[rename(k)] = v
    out["d2t"] = out["d2t"].to(torch.int64)
    out["t2d"] = out["t2d"].to(torch.bool)
    return out


def rebuild_drafter(cfg: DrafterConfig, weights: dict, embeddings: torch.Tensor) -> Eagle3Drafter:
    model = Eagle3Drafter(cfg)
    state = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
    state["embed_tokens.weight"] = embeddings.float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"export does not match the drafter: missing {missing}, unexpected {unexpected}")
    return model.eval()


# ----------------------------------------------------------------------------- EAGLE 3.1 switches

# Both engines' EAGLE-3 drafters (Llama and DeepSeek/MLA, SGLang 0.5.23 and vLLM 0.32) read these
# two keys from the top level of the draft's config (vLLM copies them there from a speculators
# config) and name the per-layer norms ``fc_norm.{i}.weight``; a 3.0 export lacks both keys and
# both engines then default them off.
SWITCH_KEYS = ("fc_norm", "norm_output")
FC_NORM_WEIGHTS = tuple(f"fc_norm.{i}.weight" for i in range(3))


def switch_fields(cfg: DrafterConfig) -> dict[str, bool]:
    """The 3.1 switches as an export's config writes them (always, on or off)."""
    return {k: bool(getattr(cfg, k)) for k in SWITCH_KEYS}


def switches_from_config(c: dict, *, aux_norm_alias: bool = False) -> dict[str, bool]:
    """The 3.1 switches an export's config asks its engine for (``aux_norm_alias``: the engine also takes
    ``fc_norm`` under the older name ``use_aux_norm``); missing keys are off, as both engines read them."""
    legacy = aux_norm_alias and c.get("use_aux_norm")
    return {"fc_norm": bool(c.get("fc_norm") or legacy), "norm_output": bool(c.get("norm_output"))}


def switch_problems(c: dict, names: set[str], *, aux_norm_alias: bool = False) -> list[str]:
    """What an engine would run differently from the drafter the weights hold: a switch that is not a
    boolean, or ``fc_norm`` on without its three norms (the engine keeps them at 1) or off with them
    (the engine drops them)."""
    problems = [f"{k} is {c[k]!r}, not a boolean" for k in (*SWITCH_KEYS, "use_aux_norm")
                if k in c and not isinstance(c[k], bool)]
    held = [n for n in FC_NORM_WEIGHTS if n in names]
    on = switches_from_config(c, aux_norm_alias=aux_norm_alias)["fc_norm"]
    if on and len(held) != len(FC_NORM_WEIGHTS):
        problems.append(f"fc_norm is on but model.safetensors lacks {sorted(set(FC_NORM_WEIGHTS) - set(held))}")
    if not on and held:
        problems.append(f"fc_norm is off but model.safetensors holds {held}, which the engine would ignore")
    return problems


def unread_switches(shape, readers: dict[str, dict[str, str]]) -> dict[str, str]:
    """``{switch: problem}`` for the 3.1 switches ``shape`` (a ``DraftShape``) turns on that one of its
    ``engines`` does not read for this kind; ``readers`` maps a switch to ``{engine: the module of the
    pinned release that reads it}`` (the formats' ``switch_readers``, ``drafter/formats``)."""
    out = {}
    for key in SWITCH_KEYS:
        missing = [e for e in shape.engines if e not in readers.get(key, {})]
        if getattr(shape, key) and missing:
            out[key] = (f"cannot be served by {', '.join(missing)}: its EAGLE-3 drafter for this kind does not "
                        f"read {key} and would run another network than was trained; drop {key} or those engines")
    return out
