"""The package as users install it from an index: a built wheel, non-editable, in a fresh virtual
environment, used from a directory outside the repository.

Only the project is installed into the new environment; its dependencies (torch, dagster, ...)
are borrowed from the test's own environment through a path file, so the test stays offline and
takes seconds instead of the minutes a full dependency install would. What it proves is what a
non-editable install changes: every module, the bundled demo prompts and recipes, and the Dagster
instance config come from the wheel, nothing is read from the checkout.
"""

import os
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from eagle3_assets.paths import REPO_ROOT

pytestmark = pytest.mark.skipif(not (REPO_ROOT / "pyproject.toml").exists(), reason="needs the source checkout")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    work = tmp_path_factory.mktemp("install")
    # build from a clean copy: an in-tree build/ directory could carry modules that no longer exist
    source = work / "source"
    shutil.copytree(REPO_ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "data", "build", "*.egg-info", "test-artifacts", "__pycache__", ".pytest_cache"))
    dist = work / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(dist), str(source)], check=True, capture_output=True, timeout=600)
    wheel = next(dist.glob("eagle3_assets-*.whl"))
    env_dir = work / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, timeout=600)
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    # dependencies only: a plain path line, so this environment's editable-install hooks never run there
    (Path(purelib) / "borrowed-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    outside = work / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "EAGLE3_HOME", "PYTHONPATH")}
    env.update(EAGLE3_HOME=str(work / "data"), HF_HUB_OFFLINE="1")
    return py, env_dir, outside, env, wheel


def _run(cmd, outside, env):
    out = subprocess.run(cmd, cwd=outside, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


def test_the_wheel_is_used_not_the_checkout(installed):
    py, env_dir, outside, env, _ = installed
    script = ("import eagle3_assets, eagle3_assets.resources as resources, eagle3_assets.sensors as sensors\n"
              "from eagle3_assets.demo import DEMO_PROMPTS\n"
              "from eagle3_assets.drafter.recipes import list_recipes, load_recipe\n"
              "print(eagle3_assets.__file__); print(resources.__file__); print(sensors.__file__)\n"
              "print(sorted(p.name for p in DEMO_PROMPTS.glob('*.jsonl')))\n"
              "print(list_recipes(), load_recipe('demo').name)\n")
    lines = _run([str(py), "-c", script], outside, env).splitlines()
    for path in lines[:3]:
        assert Path(path).resolve().is_relative_to(env_dir.resolve()), path
    assert lines[3] == "['coding.jsonl', 'general.jsonl', 'math.jsonl']"
    assert lines[4] == "['demo', 'kimi-mini'] demo"


def test_definitions_validate_and_cli_paths_from_outside_the_repo(installed):
    py, env_dir, outside, env, _ = installed
    out = _run([str(py), "-m", "dagster", "definitions", "validate", "-m", "eagle3_assets.definitions"], outside, env)
    assert "Validation successful" in out or "eagle3_assets" in out
    out = _run([str(env_dir / "bin" / "eagle3"), "paths"], outside, env)
    assert f"data root        {env['EAGLE3_HOME']}" in out


def test_the_wheel_installs_one_top_level_package(installed):
    """The repository's top-level resources/ and sensors/ folders ship inside eagle3_assets: a generic
    top-level `resources` or `sensors` would collide with any other distribution's."""
    py, env_dir, outside, env, wheel = installed
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"eagle3_assets"}, sorted(top)
    for folder in ("resources", "sensors"):
        shipped = {n.split("/")[-1] for n in names if n.startswith(f"eagle3_assets/{folder}/") and n.endswith(".py")}
        assert shipped == {p.name for p in (REPO_ROOT / folder).glob("*.py")}, folder
    script = ("import importlib.util\n"
              "print([n for n in ('resources', 'sensors') if importlib.util.find_spec(n) is not None])\n")
    assert _run([str(py), "-c", script], outside, env).strip() == "[]"
