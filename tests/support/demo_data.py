"""Session fixture (a pytest plugin of ``tests/conftest.py``): the demo recipe's three datasets run
through the graph once per session, up to ``merged_corpus``, for the tests that then train the demo
drafter on them (offline in ``test_drafter_asset.py``, streaming in ``test_streaming_asset.py``).

Each of those tests materialized the very same three datasets (four ``small_prompts`` each, the
``local`` backend's greedy replies, ``eval_fraction`` 0.5) before this fixture; each now copies
them into its own data root (``install_demo_datasets``) and goes on from there in its own instance.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

# What the graph writes for a dataset up to merged_corpus (hidden_states and drafters are the tests')
COPIED = ("prompts", "responses", "tokens", "corpus", "metadata.duckdb")


@pytest.fixture(scope="session")
def demo_datasets(model_dir, tmp_path_factory) -> Path:
    """A data root holding the demo recipe's datasets through merged_corpus, every run a success."""
    import dagster as dg

    from eagle3_assets.drafter.recipes import load_recipe
    from eagle3_assets.paths import DataLayout
    from eagle3_assets.resources import DatasetSettings
    from tests.conftest import small_prompts, write_jsonl
    from tests.support.dagster_helpers import run_dataset

    root = tmp_path_factory.mktemp("demo-datasets") / "data"
    layout = DataLayout(root)
    with pytest.MonkeyPatch.context() as mp, dg.instance_for_test() as instance:
        mp.setenv("EAGLE3_HOME", str(root))
        for name in load_recipe("demo").datasets:
            write_jsonl(layout.prompt_source(name), small_prompts(4, prefix=f"{name}-"))
            result = run_dataset(instance, name, resources={"dataset_settings": DatasetSettings(eval_fraction=0.5)})
            assert result.success, [e.message for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    return root


def install_demo_datasets(demo_root: Path, layout, instance, datasets) -> None:
    """Copy the demo datasets into ``layout``'s (empty) data root and add their partitions to ``instance``."""
    from eagle3_assets.partitions import datasets_partitions

    for name in COPIED:
        src = Path(demo_root) / name
        if src.is_dir():
            shutil.copytree(src, layout.root / name)
        else:
            layout.root.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, layout.root / name)
    instance.add_dynamic_partitions(datasets_partitions.name, list(datasets))
