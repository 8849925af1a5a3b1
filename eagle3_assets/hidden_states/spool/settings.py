"""The streaming settings of a training run (``TrainJob.stream``), defined once."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StreamSettings(BaseModel):
    """Where the spool lives, its byte cap and watermarks, how units are cut, and what epochs do."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    spool_dir: str  # under the data root (on a cluster: the shared filesystem)
    corpora: dict[str, float]  # merged-corpus parquet -> mixing weight (train split), as ``datasets`` offline
    cap_bytes: int = Field(ge=1)  # the spool never holds more (published units + live leases' reservations)
    high_water: float = Field(0.9, gt=0.0, le=1.0)  # of the cap: producers pause above it ...
    low_water: float = Field(0.7, ge=0.0, le=1.0)  # ... and resume below this
    unit_bytes: int = Field(256 << 20, ge=1)  # a unit (the grain of capture and deletion) holds at most this
    # recapture (default): every epoch's units are captured again, so the spool stays bounded whatever the
    # corpus; keep: one capture, the units stay until their last epoch's use (refused unless the corpus fits the cap)
    epochs: Literal["recapture", "keep"] = "recapture"
    dtype: Literal["bf16", "fp8"] = "bf16"  # unit storage, as the offline shards'
    layer_ids: list[int] | None = None  # the target's aux layers captured (None: the default three)
    batch_tokens: int = Field(4096, ge=1)  # producers' forward batch
    # for the preflight's idle estimate (tokens a second, all producers / all trainer ranks); None: not known
    capture_tokens_per_s: float | None = Field(None, gt=0.0)
    train_tokens_per_s: float | None = Field(None, gt=0.0)
    poll_s: float = Field(0.05, gt=0.0)  # how often a waiting side looks again
    # the trainer gives up on a unit not published after this long (None: waits; a failure the spool records
    # (failed.json: a producer found the disk full, no producer left) ends the wait at once either way)
    wait_timeout_s: float | None = Field(None, gt=0.0)

    @model_validator(mode="after")
    def _marks(self):
        if self.low_water > self.high_water:
            raise ValueError(f"'low_water' ({self.low_water}) must not exceed 'high_water' ({self.high_water})")
        if not self.corpora:
            raise ValueError("'corpora' names no corpus")
        return self
