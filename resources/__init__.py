"""Dagster resources: where data lives, the target model, generation backends, the cluster, dataset settings."""

from .openrouter import OpenRouterResource
from .settings import DatasetSettings
from .sglang import SGLangResource
from .slurm import SlurmJobConfig, SlurmResource
from .storage import StorageResource
from .target import TargetResource
from .vllm import VLLMResource

__all__ = ["DatasetSettings", "OpenRouterResource", "SGLangResource", "SlurmJobConfig", "SlurmResource",
           "StorageResource", "TargetResource", "VLLMResource"]
