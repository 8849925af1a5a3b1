"""How to read one dataset's prompt file: which columns hold what, and what to do with odd rows.

Most files need nothing: OpenAI rows (``messages``, with ``tools``), ShareGPT rows
(``conversations``, with ``tools``) and glaive-function-calling rows (``system`` and ``chat``) are
recognized by themselves. A dataset whose columns differ (Alpaca's ``instruction``/``input``,
a ``question`` column, an id called ``uid``) gets a column map, given on the command line as
``--map user=instruction+input --map id=uid`` and kept next to the file as
``prompts/<dataset>.read.json``, so the sensor, the asset and the CLI read it the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from eagle3_assets.errors import UserInputError


class ColumnMap(BaseModel):
    """Which column holds what. ``user`` (and ``system``) build a one-turn prompt from plain text
    columns; without ``user`` the row must carry ``messages`` or ``conversations``."""

    model_config = ConfigDict(extra="forbid")

    id: str = "id"
    messages: str = "messages"  # OpenAI style: [{"role", "content"}, ...]
    conversations: str = "conversations"  # ShareGPT style: [{"from", "value"}, ...]
    user: list[str] = Field(default_factory=list)  # text columns joined (blank line between) into the user turn
    system: str | None = None  # a text column that becomes the system turn (glaive: its system text, "system")
    tools: str = "tools"  # tool declarations: a list, or JSON text of one (ShareGPT's tools column)
    chat: str | None = None  # glaive's chat text ("USER: ... ASSISTANT: ..."); naming it reads rows as glaive

    @field_validator("user", mode="before")
    @classmethod
    def _one_or_many(cls, v):
        return [v] if isinstance(v, str) else v

    @property
    def is_default(self) -> bool:
        return self == ColumnMap()


class ReadOptions(BaseModel):
    """Everything a dataset's file needs to be read as intended; saved as ``<dataset>.read.json``."""

    model_config = ConfigDict(extra="forbid")

    columns: ColumnMap = Field(default_factory=ColumnMap)
    # "drop": a conversation that ends with the assistant's turn (ShareGPT and most chat dumps do)
    # becomes the prompt for that turn, whose reply the target regenerates; "refuse": a bad row.
    final_assistant: Literal["refuse", "drop"] = "refuse"
    # a prompt for every assistant turn of a conversation (the prefix before it), not only its last
    prompt_per_assistant_turn: bool = False
    skip_invalid_rows: bool = False  # skip and count bad rows instead of refusing the file
    # for a target whose chat template renders no tools (SmolLM2): write a row's declarations and calls
    # into its text (system turn, assistant turns) instead of refusing the row
    tools_in_system_turn: bool = False

    @property
    def is_default(self) -> bool:
        return self == ReadOptions()

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=2, exclude_defaults=True) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> ReadOptions:
        """The saved options, or the defaults when there is no file."""
        if not path.is_file():
            return cls()
        try:
            return cls.model_validate(json.loads(path.read_text(encoding="utf-8")))
        except (ValueError, ValidationError) as e:  # JSONDecodeError is a ValueError
            raise UserInputError(f"{path}: not valid read options ({_first_line(e)}); "
                                 f"see 'Prompt files as you have them' in docs/datasets.md") from None


MAP_KEYS = ("id", "messages", "conversations", "user", "system", "tools", "chat")


def parse_column_map(items: list[str]) -> ColumnMap:
    """``["user=instruction+input", "id=uid"]`` (or one comma-separated string) as a :class:`ColumnMap`."""
    fields: dict[str, object] = {}
    for item in (part.strip() for chunk in items for part in chunk.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not value or key not in MAP_KEYS:
            raise UserInputError(f"--map {item!r}: expected KEY=COLUMN with KEY one of {', '.join(MAP_KEYS)} "
                                 "(user=COL1+COL2 joins several text columns)")
        if key in fields:
            raise UserInputError(f"--map names {key!r} twice")
        cols = [c.strip() for c in value.split("+")]
        if any(not c for c in cols) or (len(cols) > 1 and key != "user"):
            raise UserInputError(f"--map {item!r}: only 'user' joins several columns (user=COL1+COL2)")
        fields[key] = cols if key == "user" else cols[0]
    return ColumnMap(**fields)


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return "; ".join(line.strip() for line in text[:3]) if text else type(e).__name__
