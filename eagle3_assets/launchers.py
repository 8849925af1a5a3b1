"""The places a GPU stage can run, named once: the stages' Dagster configs take ``Launcher``, a
typed choice built from ``LAUNCHERS``, so a wrong name is refused by the config schema with the
list of valid ones before any run starts."""

from __future__ import annotations

from typing import Literal

LAUNCHERS = ("local", "slurm")  # "local": this machine (one process or torchrun); "slurm": one job on the cluster
Launcher = Literal[LAUNCHERS]
