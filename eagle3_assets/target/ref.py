"""The target as a job file carries it across the process boundary, and opened once on the other side.

Every job a stage launches (training, extraction, SGLang extraction) names its target the same
way: a :class:`TargetRef`, the checkpoint directory, the identity the step computed (what the
worker records in its manifest, never recomputed there) and whether its code is trusted. The
worker calls :meth:`TargetRef.open` once and reads the target's sizes from the :class:`OpenTarget`
it gets, so no job copies them and no worker reads ``config.json`` twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from eagle3_assets.target.config import read_config, text_config


class TargetRef(BaseModel):
    """The target in a job file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_dir: str  # the checkpoint directory (config.json + safetensors), as the worker's machine sees it
    identity: dict = {}  # recorded in what the job writes (target/identity.py)
    trust_remote_code: bool = False

    @classmethod
    def of(cls, spec) -> TargetRef:
        """The reference to a :class:`~eagle3_assets.target.spec.TargetSpec` (its identity computed here)."""
        return cls(model_dir=str(spec.model_dir), identity=spec.identity, trust_remote_code=spec.trust_remote_code)

    def open(self) -> OpenTarget:
        """The target's config, read once (a missing or unreadable ``config.json`` names the directory)."""
        try:
            config = read_config(self.model_dir)
        except (OSError, ValueError) as exc:
            raise ValueError(f"target {self.model_dir}: cannot read config.json ({exc})") from None
        return OpenTarget(Path(self.model_dir), config, self.identity, self.trust_remote_code)


@dataclass(frozen=True)
class OpenTarget:
    """A target a worker opened: its directory, its whole config and its language model's sizes."""

    model_dir: Path
    config: dict
    identity: dict
    trust_remote_code: bool

    @property
    def text(self) -> dict:
        return text_config(self.config)

    @property
    def num_layers(self) -> int:
        return int(self.text["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.text["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.text["vocab_size"])
