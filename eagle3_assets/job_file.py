"""Job files: the JSON a Dagster step writes for a process it launches (``torchrun`` workers)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError


class JobFile(BaseModel):
    """A typed job description; unknown fields are refused, and a bad file names the field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def from_json(cls, path: Path | str):
        path = Path(path)
        try:
            return cls.model_validate_json(path.read_text())
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"{path}: field '{field}': {first['msg']}") from None
