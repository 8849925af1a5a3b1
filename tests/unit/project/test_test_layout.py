"""Where tests live and what ships: every test file sits in a folder the architecture page lists
(``tests/unit/<stage>/``, ``tests/integration/<engine or system>/``), helpers in ``tests/support/``,
every test path the docs cite exists, and the package holds no test-only module.

Read from the filesystem and the docs' text (no test module is imported).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PAGE = "docs/architecture.md"
# A folder row of the page's "Tests" table: | `tests/unit/prompts/` | ... |
FOLDER_ROW = re.compile(r"^\| `(tests/(?:unit|integration|support)(?:/[a-z_]+)?/)` \|", re.M)
# Where the docs, benchmarks and scripts cite tests by path or module name.
CITING = ["README.md", "docs/*.md", "benchmarks/*.py", "deploy/**/*.yaml", "Makefile", ".ci/run", "tests/**/*.py"]
TEST_PATH = re.compile(r"\btests/[\w/]*?\w+\.py\b")
TEST_MODULE = re.compile(r"(?<![\w./-])tests(?:\.[a-z_0-9]+)+")


def listed_folders(root: Path = ROOT) -> set[str]:
    """The test folders the architecture page's Tests section lists."""
    after = re.split(r"^## Tests\s*$", (root / PAGE).read_text(), maxsplit=1, flags=re.M)[1:]
    return set(FOLDER_ROW.findall(re.split(r"^## ", after[0], maxsplit=1, flags=re.M)[0])) if after else set()


def misplaced_tests(root: Path = ROOT) -> list[str]:
    """Test files outside the listed unit/ and integration/ folders, and listed folders without one."""
    allowed = {f for f in listed_folders(root) if f.count("/") == 3 and not f.startswith("tests/support")}
    found = sorted(p.relative_to(root).as_posix() for p in (root / "tests").rglob("test_*.py"))
    wrong = [f"{path} (not in a listed folder)" for path in found if path.rpartition("/")[0] + "/" not in allowed]
    empty = [f"{folder} (listed, holds no test file)" for folder in sorted(allowed)
             if not any(path.startswith(folder) for path in found)]
    return wrong + empty


def folders_without_init(root: Path = ROOT) -> list[str]:
    """Folders under tests/ that are not packages (the dotted imports ``tests.support.x`` need them all)."""
    folders = [root / "tests", *(p for p in (root / "tests").rglob("*") if p.is_dir() and p.name != "__pycache__")]
    return sorted(p.relative_to(root).as_posix() for p in folders if not (p / "__init__.py").is_file())


def test_every_test_file_sits_in_a_folder_the_architecture_page_lists():
    assert {"tests/support/", "tests/unit/prompts/", "tests/integration/slurm/"} <= listed_folders()
    assert not misplaced_tests(), "move the test, or list its folder in the Tests section of " + PAGE + ": " + ", ".join(
        misplaced_tests())
    assert not folders_without_init(), f"folders without __init__.py: {folders_without_init()}"


def test_the_folder_check_names_an_injected_misplaced_test(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / PAGE).write_text("## Tests\n\n| folder | holds |\n|---|---|\n| `tests/unit/prompts/` | x |\n"
                                 "| `tests/unit/corpus/` | y |\n| `tests/support/` | z |\n")
    for path in ("tests/unit/prompts/test_a.py", "tests/test_flat.py", "tests/unit/drafter/test_b.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    (tmp_path / "tests" / "__init__.py").write_text("")
    assert misplaced_tests(tmp_path) == ["tests/test_flat.py (not in a listed folder)",
                                         "tests/unit/drafter/test_b.py (not in a listed folder)",
                                         "tests/unit/corpus/ (listed, holds no test file)"]
    assert folders_without_init(tmp_path) == ["tests/unit", "tests/unit/drafter", "tests/unit/prompts"]


def test_every_test_file_runs_in_one_lane_of_make_test():
    from tests.support.lanes import LANES

    found = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py"))
    lanes_of = {path: [lane for lane, folders in LANES.items() for folder in folders if path.startswith(folder + "/")]
                for path in found}
    assert found and all(len(lanes) == 1 for lanes in lanes_of.values()), \
        f"test files in no lane or in two of tests/support/lanes.py's LANES: {[p for p, ls in lanes_of.items() if len(ls) != 1]}"


def test_only_helpers_sit_in_tests_support():
    assert not list((ROOT / "tests" / "support").glob("test_*.py"))


def shipped_test_support(root: Path = ROOT) -> list[str]:
    """Shipped files that are test support: anything under eagle3_assets/testing (what users run at
    run time lives with what runs it: SGLang's CPU support in engines/sglang/cpu/), and any shipped
    module importing the tests package."""
    found = []
    testing = root / "eagle3_assets" / "testing"
    for path in sorted(testing.rglob("*")) if testing.is_dir() else []:
        name = path.relative_to(root).as_posix()
        if path.is_file() and "__pycache__" not in path.parts:
            found.append(name)
    for folder in ("eagle3_assets", "resources", "sensors"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                found += [f"{path.relative_to(root).as_posix()}:{node.lineno} imports {n}" for n in names
                          if n.partition(".")[0] == "tests"]
    return found


def test_the_package_ships_no_test_only_module():
    assert not shipped_test_support(), "test support belongs in tests/support/: " + ", ".join(shipped_test_support())


def test_the_shipping_check_names_injected_test_support(tmp_path):
    for folder in ("eagle3_assets/testing", "eagle3_assets/engines/sglang/cpu/hook", "eagle3_assets/loopback",
                   "resources", "sensors"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "eagle3_assets/engines/sglang/cpu/hook/sitecustomize.py").write_text("")
    (tmp_path / "eagle3_assets/testing/slurm_cluster.py").write_text("")
    (tmp_path / "eagle3_assets/loopback/__init__.py").write_text("import os\n")
    (tmp_path / "resources/sglang.py").write_text("def f():\n    from tests.support.capture import local_capture\n")
    assert shipped_test_support(tmp_path) == ["eagle3_assets/testing/slurm_cluster.py",
                                              "resources/sglang.py:2 imports tests.support.capture"]


def cited_but_missing(root: Path = ROOT) -> list[str]:
    """`file: name` for each test file path or ``tests.`` module name cited that does not exist."""
    missing = []
    for pattern in CITING:
        for path in sorted(root.glob(pattern)):
            if path.resolve() == Path(__file__).resolve():
                continue  # this file's own examples
            text = path.read_text()
            for cited in sorted(set(TEST_PATH.findall(text))):
                if not (root / cited).is_file():
                    missing.append(f"{path.relative_to(root).as_posix()}: {cited}")
            for cited in sorted(set(TEST_MODULE.findall(text))):
                base = root / cited.replace(".", "/")
                # `tests.x.y` names a module, or `tests.x.y.name` something inside one
                parents = [base, *base.parents]
                if not any(p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()
                           for p in parents[:2] if p != root):
                    missing.append(f"{path.relative_to(root).as_posix()}: {cited}")
    return missing


def test_every_test_the_docs_cite_exists():
    assert not cited_but_missing(), "cited tests that are not there: " + ", ".join(cited_but_missing())
