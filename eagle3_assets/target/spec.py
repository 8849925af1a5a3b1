"""One definition of the target model, shared by every stage.

A :class:`TargetSpec` names the checkpoint directory, the tokenizer, the name sample ids and
manifests use, and the name HTTP backends serve the model under. Stages read its config (the
language model's part, ``text_config``, for multimodal checkpoints such as Kimi-K2.5), its
tokenizer and its identity from here, never from a second copy of the same settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from eagle3_assets.target.config import read_config, text_config
from eagle3_assets.target.identity import check_same_target, target_identity


@dataclass(frozen=True)
class TargetSpec:
    model_dir: Path
    name: str = ""  # sample ids and manifests; empty: the directory's name
    served_name: str = ""  # what OpenAI-compatible servers call it (an OpenRouter slug); empty: name
    tokenizer_dir: Path | None = None  # empty: model_dir
    trust_remote_code: bool = False
    end_of_turn: str = ""  # empty: the chat template's turn end, else the tokenizer's eos_token
    thinking: bool | None = None  # passed to the chat template as ``thinking`` when set
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "model_dir", Path(self.model_dir))
        if not (self.model_dir / "config.json").is_file():
            raise FileNotFoundError(f"target model directory {self.model_dir} has no config.json")
        if not self.name:
            object.__setattr__(self, "name", self.model_dir.name)
        if not self.served_name:
            object.__setattr__(self, "served_name", self.name)
        if self.tokenizer_dir is None:
            object.__setattr__(self, "tokenizer_dir", self.model_dir)
        object.__setattr__(self, "tokenizer_dir", Path(self.tokenizer_dir))

    @cached_property
    def config(self) -> dict:
        """The checkpoint's whole ``config.json``."""
        return read_config(self.model_dir)

    @property
    def text_config(self) -> dict:
        """The language model's config: ``text_config`` of a multimodal wrapper, else the config."""
        return text_config(self.config)

    @property
    def context_length(self) -> int | None:
        """Positions the model takes (``max_position_embeddings``), when the config says."""
        n = self.text_config.get("max_position_embeddings") or self.config.get("max_position_embeddings")
        return int(n) if isinstance(n, int) and n > 0 else None

    @cached_property
    def identity(self) -> dict:
        return target_identity(self.model_dir, self.name)

    def check_recorded(self, recorded: dict | None, what: str) -> None:
        """Refuse data made by another target (see :func:`check_same_target`)."""
        check_same_target(recorded, self.identity, what)

    def stop_token_ids(self) -> list[int]:
        """Every id a decode loop of this target stops on: its eos ids and its template's end of turn."""
        from eagle3_assets.target.stops import decode_stop_ids

        return decode_stop_ids(self.model_dir, self.load_tokenizer())

    def load_tokenizer(self):
        """The target's :class:`~eagle3_assets.target.tokenizer.TargetTokenizer` (loaded once)."""
        if "tokenizer" not in self._cache:
            from eagle3_assets.target.tokenizer import TargetTokenizer

            self._cache["tokenizer"] = TargetTokenizer.load(
                self.tokenizer_dir, end_of_turn=self.end_of_turn, trust_remote_code=self.trust_remote_code,
                thinking=self.thinking, config_dir=self.model_dir)
        return self._cache["tokenizer"]
