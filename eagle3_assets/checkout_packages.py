"""Run from a source checkout, `eagle3_assets.resources` and `eagle3_assets.sensors` are the
repository's top-level `resources/` and `sensors/` folders.

The wheel (setup.py's package-dir) and an editable install (setuptools' finder) already map them
there; this finder does the same when the checkout is used without installing it (the repository
root on sys.path, as the tests, benchmarks and `PYTHONPATH=$PWD` runs do). It answers for those two
exact names and nothing else, and only when the package folder does not hold them itself: an
installed wheel never uses it. It goes first on sys.meta_path, so a checkout on PYTHONPATH gets its
own folders even where another checkout of the project is installed in editable mode.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
TOP_LEVEL_FOLDERS = ("resources", "sensors")


class CheckoutFolders(importlib.abc.MetaPathFinder):
    """`eagle3_assets.<folder>` -> the checkout's `<folder>/` package."""

    def __init__(self, folders: dict[str, Path]):
        self.folders = folders

    def find_spec(self, fullname, path=None, target=None):
        folder = self.folders.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)])


def folders_to_map(package: Path = PACKAGE) -> dict[str, Path]:
    """The top-level folders of the checkout this package sits in that it does not hold itself."""
    root = package.parent
    if not (root / "pyproject.toml").is_file():
        return {}
    return {f"{package.name}.{name}": root / name for name in TOP_LEVEL_FOLDERS
            if not (package / name).exists() and (root / name / "__init__.py").is_file()}


def install() -> None:
    folders = folders_to_map()
    if folders and not any(isinstance(f, CheckoutFolders) for f in sys.meta_path):
        sys.meta_path.insert(0, CheckoutFolders(folders))
