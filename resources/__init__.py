"""Dagster resources: where data lives, the target model and tokenizer, generation backends."""

from .local_model import EmbeddedModelResource
from .openrouter import OpenRouterResource
from .settings import DatasetSettings
from .sglang import SGLangResource
from .storage import StorageResource
from .tokenizer import TokenizerResource

__all__ = ["DatasetSettings", "EmbeddedModelResource", "OpenRouterResource", "SGLangResource",
           "StorageResource", "TokenizerResource"]
