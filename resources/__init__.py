"""Dagster resources: where data lives, the embedded target model, the tokenizer, settings."""

from .local_model import EmbeddedModelResource
from .settings import DatasetSettings
from .storage import StorageResource
from .tokenizer import TokenizerResource

__all__ = ["DatasetSettings", "EmbeddedModelResource", "StorageResource", "TokenizerResource"]
