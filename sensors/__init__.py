"""Sensors: new prompt files become dataset partitions."""

from .prompt_files import prompt_files_sensor

__all__ = ["prompt_files_sensor"]
