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

from eagle3_assets.errors import UserInputError

REPO_ROOT = Path(__file__).resolve().parents[1]
BUNDLED = Path(__file__).resolve().parent / "bundled"  # demo prompts and recipes, shipped in the package
DATASET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# A dataset's prompt file, in the order they are preferred; one file per dataset.
PROMPT_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
# Columns of the normalized prompt table, which older versions wrote next to the prompt files.
_LEGACY_TABLE_COLUMNS = ["prompt_id", "messages", "turns", "line"]


def prompt_file_suffix(path: Path | str) -> str | None:
    """The prompt-file suffix of ``path`` (``.jsonl.gz`` counts as one), or None."""
    name = Path(path).name
    return next((s for s in PROMPT_SUFFIXES if name.endswith(s) and len(name) > len(s)), None)


def prompt_file_dataset(path: Path | str) -> str | None:
    """The dataset a prompt file names (``my_set.jsonl.gz`` -> ``my_set``), or None."""
    suffix = prompt_file_suffix(path)
    return Path(path).name[: -len(suffix)] if suffix else None


def _is_legacy_table(path: Path) -> bool:
    import pyarrow.parquet as pq

    try:
        return pq.read_schema(path).names == _LEGACY_TABLE_COLUMNS
    except Exception:  # unreadable: not ours to judge here; the reader reports it
        return False


def default_data_root() -> Path:
    env = os.environ.get("EAGLE3_HOME")
    if env:
        return Path(env).expanduser().resolve()
    if (REPO_ROOT / "pyproject.toml").exists():
        return REPO_ROOT / "data"
    return Path.cwd() / "data"


def check_dataset_name(name: str) -> str:
    if not DATASET_NAME.match(name):
        raise UserInputError(
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

    def prompt_file(self, dataset: str, suffix: str = ".jsonl") -> Path:
        """Where a prompt file of ``dataset`` with ``suffix`` lives (whether or not it exists)."""
        if suffix not in PROMPT_SUFFIXES:
            raise UserInputError(f"prompt files end in {', '.join(PROMPT_SUFFIXES)}, not {suffix!r}")
        return self.prompts_dir / f"{dataset}{suffix}"

    def prompt_sources(self, dataset: str) -> list[Path]:
        """Every prompt file of ``dataset`` on disk (normally one). A normalized table left here by an
        older version is not a prompt file when the dataset has another."""
        found = [p for p in (self.prompts_dir / f"{dataset}{s}" for s in PROMPT_SUFFIXES) if p.is_file()]
        if len(found) > 1:
            found = [p for p in found if not (p.suffix == ".parquet" and _is_legacy_table(p))]
        return found

    def prompt_source(self, dataset: str) -> Path:
        """The dataset's prompt file; ``prompts/<dataset>.jsonl`` when there is none yet."""
        found = self.prompt_sources(dataset)
        if len(found) > 1:
            raise UserInputError(
                f"dataset {dataset!r} has {len(found)} prompt files ({', '.join(p.name for p in found)}) "
                f"in {self.prompts_dir}: keep one")
        return found[0] if found else self.prompt_file(dataset)

    def prompt_read_options(self, dataset: str) -> Path:
        """How to read the dataset's prompt file (column map, ...), when it needs saying."""
        return self.prompts_dir / f"{dataset}.read.json"

    def prompt_table(self, dataset: str) -> Path:
        return self.prompts_dir / "tables" / f"{dataset}.parquet"

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
        """Dataset names with a prompt file (any of ``PROMPT_SUFFIXES``), sorted."""
        if not self.prompts_dir.is_dir():
            return []
        names = {prompt_file_dataset(p) for p in self.prompts_dir.iterdir() if p.is_file()}
        return sorted(n for n in names if n and DATASET_NAME.match(n) and self.prompt_sources(n))


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
