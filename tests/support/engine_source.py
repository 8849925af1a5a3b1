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


def unread(python: str, engine: str) -> list[str]:
    """The ``kind switch: module`` pairs of ``engine``'s serving formats' ``switch_readers`` whose module,
    as installed, never reads the switch's config key (as a string literal: ``getattr(config, "key"``)."""
    from eagle3_assets.drafter import formats

    return [f"{kind} {key}: {module}" for kind, e in formats.FORMATS if e == engine
            for key, module in formats.for_(kind, e).switch_readers.items()
            if f'"{key}"' not in module_source(python, module)]
