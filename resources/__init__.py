"""Dagster resources: where data lives, the target model, generation backends, dataset settings."""

from .openrouter import OpenRouterResource
from .settings import DatasetSettings
from .sglang import SGLangResource
from .storage import StorageResource
from .target import TargetResource
from .vllm import VLLMResource

__all__ = ["DatasetSettings", "OpenRouterResource", "SGLangResource", "StorageResource", "TargetResource",
           "VLLMResource"]
