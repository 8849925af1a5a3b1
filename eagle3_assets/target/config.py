"""The target's ``config.json``, and its language model's part wherever a checkpoint keeps it.

A multimodal checkpoint such as Kimi-K2.5 wraps its language model's settings in ``text_config``;
every reader of the target's sizes (layers, hidden size, vocabulary, rope, norms) asks
:func:`text_config` instead of looking in two places itself.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_config(model_dir: Path | str) -> dict:
    """The checkpoint's whole ``config.json``."""
    return json.loads((Path(model_dir) / "config.json").read_text())


def text_config(config):
    """The language model's config: ``text_config`` of a multimodal wrapper, else the config itself.
    ``config`` is ``config.json`` as a dict or a ``transformers`` config object."""
    inner = config.get("text_config") if isinstance(config, dict) else getattr(config, "text_config", None)
    return inner or config
