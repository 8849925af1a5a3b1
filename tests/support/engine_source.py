"""The source text of an engine's module as installed in the engine's own environment, found without
importing the engine (its top-level package's location only)."""

from __future__ import annotations

import subprocess
from pathlib import Path

FIND = ("import importlib.util, sys; top, _, rest = sys.argv[1].partition('.'); "
        "print(list(importlib.util.find_spec(top).submodule_search_locations)[0])")


def module_source(python: str, module: str) -> str:
    root = subprocess.run([python, "-c", FIND, module], check=True, capture_output=True, text=True).stdout.strip()
    return (Path(root) / (module.partition(".")[2].replace(".", "/") + ".py")).read_text()


def unread(python: str, readers: dict[str, dict[str, str]], engine: str) -> list[str]:
    """The ``switch: module`` pairs of a kind's ``SWITCH_READERS`` for ``engine`` whose module, as
    installed, never reads the switch's config key (as a string literal: ``getattr(config, "key"``)."""
    return [f"{key}: {mods[engine]}" for key, mods in readers.items()
            if engine in mods and f'"{key}"' not in module_source(python, mods[engine])]
