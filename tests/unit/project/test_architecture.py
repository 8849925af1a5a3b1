"""The code's shape: no import cycle between project modules, no module over 400 lines.

Imports are read with ast (no module is imported), function-local ones included, relative ones
resolved, so a cycle hidden inside a function still counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# folder -> the dotted name its modules are imported as: the top-level resources/ and sensors/ folders
# are installed inside eagle3_assets (setup.py), so their modules are eagle3_assets.resources.*.
PACKAGES = {"eagle3_assets": "eagle3_assets", "resources": "eagle3_assets.resources",
            "sensors": "eagle3_assets.sensors", "benchmarks": "benchmarks"}
MAX_LINES = 400


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the project's packages."""
    modules: dict[str, Path] = {}
    for folder, dotted in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = [dotted, *path.relative_to(root / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that MODULE imports anywhere in its file."""
    found: set[str] = set()

    def add(name: str) -> None:
        # `import a.b.c` and `from a.b import c` name the deepest project module they reach.
        # Benchmarks are scripts run from their folder: `from reference_row import x` there is
        # benchmarks.reference_row.
        if module.startswith("benchmarks.") and f"benchmarks.{name.partition('.')[0]}" in modules:
            name = f"benchmarks.{name}"
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)

    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node)
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                add(submodule if submodule in modules else target)
    return found


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one module (Tarjan), as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = project_modules(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def _without_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's __init__ re-exporting its submodules is not a cycle with them: drop the edges
    from a submodule up to its own ancestor packages (Python imports those first anyway)."""
    return {
        name: {t for t in targets if not name.startswith(t + ".")} for name, targets in graph.items()
    }


def test_no_import_cycles_between_project_modules():
    cycles = find_cycles(_without_package_inits(import_graph()))
    assert not cycles, "import cycles between project modules: " + "; ".join(
        " <-> ".join(cycle) for cycle in cycles
    )


def test_no_module_over_400_lines():
    too_long = {
        name: n
        for name, path in project_modules().items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not too_long, f"modules over {MAX_LINES} lines: " + ", ".join(
        f"{name} ({n} lines)" for name, n in sorted(too_long.items())
    )


def test_the_cycle_check_names_an_injected_cycle(tmp_path):
    """The checker itself: a two-module circle through a function-local relative import is found."""
    package = tmp_path / "eagle3_assets" / "stage"
    package.mkdir(parents=True)
    (tmp_path / "eagle3_assets" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("from .a import f\n")
    (package / "a.py").write_text("from eagle3_assets.stage.b import g\n\ndef f():\n    return g\n")
    (package / "b.py").write_text("def g():\n    from . import a\n    return a\n")
    for other in list(PACKAGES)[1:]:
        (tmp_path / other).mkdir()
    cycles = find_cycles(_without_package_inits(import_graph(tmp_path)))
    assert cycles == [["eagle3_assets.stage.a", "eagle3_assets.stage.b"]]


def checkout_only_imports(root: Path = ROOT) -> list[str]:
    """`file:line name` for each import of a top-level `resources` or `sensors`: those names exist only
    in a checkout (the wheel ships the folders as eagle3_assets.resources and eagle3_assets.sensors)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if {"data", "build", "test-artifacts"} & set(path.relative_to(root).parts[:1]) or ".venv" in str(path):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{path.relative_to(root)}:{node.lineno} {n}" for n in names
                      if n.partition(".")[0] in ("resources", "sensors")]
    return found


def test_nothing_imports_resources_or_sensors_as_top_level_packages():
    assert not checkout_only_imports(), "import eagle3_assets.resources / eagle3_assets.sensors instead: " + ", ".join(
        checkout_only_imports())


def test_the_import_check_names_an_injected_top_level_import(tmp_path):
    (tmp_path / "tool.py").write_text("import os\n\ndef f():\n    from resources import StorageResource\n")
    (tmp_path / "other.py").write_text("import sensors.alerts\nfrom eagle3_assets.sensors import build_alert\n")
    assert checkout_only_imports(tmp_path) == ["other.py:1 sensors.alerts", "tool.py:4 resources"]


# The data root's one rule is DataLayout.from_env (``$EAGLE3_HOME``, else ``data/``); inside a run
# every stage and sensor takes it from the `storage` resource. These are the only modules that read
# it from the environment, each where no resource exists (docs/architecture.md, "The data root").
ENVIRONMENT_ROOT_READERS = {
    "eagle3_assets.resources.storage": "the storage resource itself: its root, else the rule",
    "eagle3_assets.resources.target": "the model cache ($EAGLE3_MODEL_CACHE, else under the root)",
    "eagle3_assets.drafter.recipes": "the recipe partitions, listed when the definitions load",
    "eagle3_assets.cli": "the CLI, outside Dagster; it hands its root to Dagster as $EAGLE3_HOME",
    "eagle3_assets.demo": "the demo, outside Dagster, as the CLI",
    "eagle3_assets.drafter.vllm_acceptance": "a measurement run by hand, its layout a parameter",
}


def environment_root_readers(root: Path = ROOT) -> set[str]:
    """Shipped modules that call DataLayout.from_env or default_data_root (paths.py, the rule, aside)."""
    found = set()
    for name, path in project_modules(root).items():
        if name.startswith("benchmarks") or name == "eagle3_assets.paths":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            func = node.func if isinstance(node, ast.Call) else None
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if called in ("from_env", "default_data_root"):
                found.add(name)
    return found


def test_the_data_root_comes_from_the_environment_only_where_no_resource_exists():
    assert environment_root_readers() == set(ENVIRONMENT_ROOT_READERS), (
        "modules reading the data root from the environment changed: inside a run take it from the "
        f"storage resource; found {sorted(environment_root_readers())}")


def test_the_root_reader_check_names_an_injected_reader(tmp_path):
    for folder in PACKAGES:
        (tmp_path / folder).mkdir()
    (tmp_path / "resources" / "storage.py").write_text("def layout(root):\n    return DataLayout.from_env(root)\n")
    (tmp_path / "eagle3_assets" / "stage.py").write_text("from eagle3_assets.paths import default_data_root as r\n"
                                                         "def f():\n    return default_data_root()\n")
    (tmp_path / "eagle3_assets" / "paths.py").write_text("def default_data_root():\n    return 1\n")
    assert environment_root_readers(tmp_path) == {"eagle3_assets.resources.storage", "eagle3_assets.stage"}
