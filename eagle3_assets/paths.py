"""Where every file of the platform lives, under one data root.

The root is ``$EAGLE3_HOME`` when set, else ``data/`` in the repository (or the working
directory when the package is installed elsewhere). The Dagster instance lives under it too,
so the demo, ``make ui`` and the command line all see the same runs.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BUNDLED = Path(__file__).resolve().parent / "bundled"  # demo prompts and recipes, shipped in the package
DATASET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def default_data_root() -> Path:
    env = os.environ.get("EAGLE3_HOME")
    if env:
        return Path(env).expanduser().resolve()
    if (REPO_ROOT / "pyproject.toml").exists():
        return REPO_ROOT / "data"
    return Path.cwd() / "data"


def check_dataset_name(name: str) -> str:
    if not DATASET_NAME.match(name):
        raise ValueError(
            f"dataset name {name!r} is not usable as a partition key: use letters, digits, '_', '-', '.'"
        )
    return name


@dataclass(frozen=True)
class DataLayout:
    """Every file of the graph under the data root, one method per kind of file."""

    root: Path

    @classmethod
    def from_env(cls, root: str | os.PathLike | None = None) -> DataLayout:
        return cls(Path(root).expanduser().resolve() if root else default_data_root())

    @property
    def prompts_dir(self) -> Path:
        return self.root / "prompts"

    def prompt_source(self, dataset: str) -> Path:
        return self.prompts_dir / f"{dataset}.jsonl"

    def prompt_table(self, dataset: str) -> Path:
        return self.prompts_dir / f"{dataset}.parquet"

    def responses_dir(self, dataset: str) -> Path:
        return self.root / "responses" / dataset

    def tokens(self, dataset: str) -> Path:
        return self.root / "tokens" / f"{dataset}.parquet"

    def corpus(self, dataset: str) -> Path:
        return self.root / "corpus" / f"{dataset}.parquet"

    def hidden_states_dir(self, dataset: str) -> Path:
        return self.root / "hidden_states" / dataset

    def drafter_dir(self, recipe: str) -> Path:
        return self.root / "drafters" / recipe

    @property
    def metadata_db(self) -> Path:
        return self.root / "metadata.duckdb"

    @property
    def models_dir(self) -> Path:
        return Path(os.environ.get("EAGLE3_MODEL_CACHE") or self.root / "models")

    @property
    def dagster_home(self) -> Path:
        return self.root / "dagster"

    @property
    def alerts_file(self) -> Path:
        return self.root / "alerts.jsonl"

    def datasets_on_disk(self) -> list[str]:
        """Dataset names with a prompt file, sorted."""
        if not self.prompts_dir.is_dir():
            return []
        return sorted(p.stem for p in self.prompts_dir.glob("*.jsonl") if DATASET_NAME.match(p.stem))


WORKSPACE = """load_from:
  - python_module:
      module_name: eagle3_assets.definitions
      location_name: eagle3_assets
"""


def write_workspace(layout: DataLayout) -> Path:
    """The workspace file ``eagle3 ui`` serves, in the Dagster home: it names the installed package,
    so it works from any directory and from a non-editable install (``workspace.yaml`` at the
    repository root says the same for ``dagster dev`` run in a checkout)."""
    path = ensure_dagster_home(layout) / "workspace.yaml"
    path.write_text(WORKSPACE)
    return path


def ensure_dagster_home(layout: DataLayout) -> Path:
    """Create ``$DAGSTER_HOME`` under the data root with the project's instance config."""
    home = layout.dagster_home
    home.mkdir(parents=True, exist_ok=True)
    target = home / "dagster.yaml"
    if not target.exists():
        shutil.copyfile(Path(__file__).with_name("dagster_instance.yaml"), target)
    return home
