"""The code's shape: no import cycle between project modules, no module over 400 lines, no drafter
module outside the serving-format registry naming an engine.

Imports are read with ast (no module is imported), function-local ones included, relative ones
resolved, so a cycle hidden inside a function still counts.
"""

from __future__ import annotations

import ast
import re
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


# The pipeline's layers, lowest first. A module may import its own package, an earlier stage and a lower
# layer, never a later stage or a higher layer (docs/architecture.md, "The layers"). Each name is a
# module or a package of eagle3_assets (the longest that matches a module decides); every module must
# fall in one, so a new top-level module or package is classified when it is added. The floor is the
# target (its definition, tokenizer, tool-call formats, layer ids) and the generic helpers; above it
# what the stages run on: the engines, the launchers and the Dagster resources (configuration and
# connections, the assets' parameters); the stages in pipeline order; on top what assembles and drives them.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("floor", ("eagle3_assets", "eagle3_assets.target", "eagle3_assets.checkout_packages", "eagle3_assets.errors",
               "eagle3_assets.files", "eagle3_assets.job_file", "eagle3_assets.metadata", "eagle3_assets.partitions",
               "eagle3_assets.paths", "eagle3_assets.plots", "eagle3_assets.processes", "eagle3_assets.querying",
               "eagle3_assets.runs")),
    ("engines, launchers and resources", ("eagle3_assets.engines", "eagle3_assets.launchers", "eagle3_assets.slurm",
                                          "eagle3_assets.resources")),
    ("prompts", ("eagle3_assets.prompts",)),
    ("generation", ("eagle3_assets.generation",)),
    ("tokens", ("eagle3_assets.tokens",)),
    ("corpus", ("eagle3_assets.corpus",)),
    ("hidden_states", ("eagle3_assets.hidden_states",)),
    ("drafter", ("eagle3_assets.drafter",)),
    ("serving", ("eagle3_assets.serving",)),
    ("top", ("eagle3_assets.definitions", "eagle3_assets.cli", "eagle3_assets.demo", "eagle3_assets.launch",
             "eagle3_assets.graphql_client", "eagle3_assets.sensors", "eagle3_assets.loopback",
             "benchmarks")),
]
# The backward imports still in the tree, each with its reason; the rule fails on any other, and on an
# entry here that no longer exists. None is left: the last ones were the HTTP engines' resources building
# the generation stage's backends, which now live with their engines (engines/<name>/, on the shared wire
# of engines/http/) and are built by each engine's generate role from its resource's settings.
LAYER_EXCEPTIONS: dict[tuple[str, str], str] = {}


def layer_of(module: str) -> tuple[int, str] | None:
    """(rank, the layer's name) of MODULE: the layer holding the longest name that is MODULE or a package above it."""
    best: tuple[int, int, str] | None = None
    for rank, (layer, names) in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > best[0]):
                best = (len(name), rank, layer)
    return None if best is None else (best[1], best[2])


def backward_imports(graph: dict[str, set[str]]) -> list[str]:
    """`importer -> imported (layer < layer)` for each import of a later stage or a higher layer."""
    found = []
    for module, targets in sorted(graph.items()):
        source = layer_of(module)
        for target in sorted(targets):
            to = layer_of(target)
            if source and to and to[0] > source[0] and (module, target) not in LAYER_EXCEPTIONS:
                found.append(f"{module} -> {target} ({source[1]} < {to[1]})")
    return found


def unclassified_modules(graph: dict[str, set[str]]) -> list[str]:
    return sorted(name for name in graph if layer_of(name) is None)


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between top-level modules and packages (eagle3_assets.X, benchmarks), without
    the backward imports listed in LAYER_EXCEPTIONS (each closes a cycle until it goes)."""
    def package(name: str) -> str:
        parts = name.split(".")
        return ".".join(parts[:2]) if parts[0] == "eagle3_assets" else parts[0]

    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        edges = packages.setdefault(package(module), set())
        edges |= {package(t) for t in targets
                  if package(t) != package(module) and t != "eagle3_assets" and (module, t) not in LAYER_EXCEPTIONS}
    return packages


def test_every_module_is_in_a_layer():
    assert not unclassified_modules(import_graph()), "add to LAYERS: " + ", ".join(unclassified_modules(import_graph()))


def test_no_module_imports_a_later_stage_or_a_higher_layer():
    found = backward_imports(import_graph())
    assert not found, f"{len(found)} backward imports: " + "; ".join(found)


def stale_exceptions(graph: dict[str, set[str]]) -> list[str]:
    """`importer -> imported` for each LAYER_EXCEPTIONS entry that is no longer an import."""
    return [f"{a} -> {b}" for a, b in LAYER_EXCEPTIONS if b not in graph.get(a, ())]


def test_every_listed_exception_is_still_an_import():
    gone = stale_exceptions(import_graph())
    assert not gone, "remove from LAYER_EXCEPTIONS, no longer imported: " + ", ".join(gone)


def test_no_import_cycles_between_packages():
    cycles = find_cycles(package_graph(import_graph()))
    assert not cycles, "import cycles between packages: " + "; ".join(" <-> ".join(c) for c in cycles)


def _tree_with_backward_imports(tmp_path: Path) -> dict[str, set[str]]:
    """A written tree: a floor module reaching up into a stage through a function-local relative
    import, a stage importing a later one, and imports down and sideways."""
    root = tmp_path / "eagle3_assets"
    for package in ("target", "prompts", "tokens"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "errors.py").write_text("class UserInputError(ValueError):\n    pass\n")
    (root / "target" / "spec.py").write_text("from eagle3_assets.errors import UserInputError\n\n"
                                              "def load():\n    from ..tokens import table\n    return table, UserInputError\n")
    (root / "tokens" / "table.py").write_text("from eagle3_assets.target.spec import load\nfrom . import vocab\n")
    (root / "tokens" / "vocab.py").write_text("")
    (root / "prompts" / "build.py").write_text("import eagle3_assets.tokens.vocab\n")
    for other in list(PACKAGES)[1:]:
        (tmp_path / other).mkdir()
    return import_graph(tmp_path)


def test_the_layer_rule_names_an_injected_backward_import(tmp_path):
    """The checker itself: both backward imports are named; imports down and sideways are not."""
    graph = _tree_with_backward_imports(tmp_path)
    assert backward_imports(graph) == [
        "eagle3_assets.prompts.build -> eagle3_assets.tokens.vocab (prompts < tokens)",
        "eagle3_assets.target.spec -> eagle3_assets.tokens.table (floor < tokens)",
    ]
    assert find_cycles(package_graph(graph)) == [["eagle3_assets.target", "eagle3_assets.tokens"]]
    assert unclassified_modules(graph) == []


def test_a_listed_exception_excuses_its_one_import_and_its_package_edge(tmp_path, monkeypatch):
    """The list (empty in the tree) still works: an entry excuses that import only, in the layer rule
    and in the package graph, and the stale-entry check names an entry that is no import."""
    graph = _tree_with_backward_imports(tmp_path)
    monkeypatch.setitem(LAYER_EXCEPTIONS, ("eagle3_assets.target.spec", "eagle3_assets.tokens.table"), "a reason")
    assert backward_imports(graph) == ["eagle3_assets.prompts.build -> eagle3_assets.tokens.vocab (prompts < tokens)"]
    assert find_cycles(package_graph(graph)) == []
    monkeypatch.setitem(LAYER_EXCEPTIONS, ("eagle3_assets.target.spec", "eagle3_assets.tokens.vocab"), "no such import")
    assert stale_exceptions(graph) == ["eagle3_assets.target.spec -> eagle3_assets.tokens.vocab"]


# ----------------------------------------------------------------------------- engine names in the drafter stage

ENGINE_NAMES = re.compile("sglang|vllm", re.IGNORECASE)
FORMATS_PACKAGE = "drafter/formats/"  # the serving-format registry: one module per (kind, engine) names its engine
# file under eagle3_assets/ -> {identifier: why it may name an engine}; the rule fails on an entry no longer named
ENGINE_NAME_EXCEPTIONS = {
    "drafter/assets.py": {
        "vllm_server_args": "the streaming producers' Dagster config, one field per capture engine, as hidden_states'",
        "sglang_server_args": "the same, for the tensor-parallel capture",
    },
    "drafter/stream_jobs.py": {
        "vllm_server_args": "hands the producers' config field to the extract role's job settings",
        "sglang_server_args": "the same, for the tensor-parallel capture",
    },
    # the whole module: a measurement run by hand under this name (docs/drafter.md); measure_recipe takes any
    # serve engine, its command line prints vLLM's figures
    "drafter/vllm_acceptance.py": {"*": "the command users run, python -m eagle3_assets.drafter.vllm_acceptance"},
}


def _docstring_nodes(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (prose may name an engine; code may not)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def engine_names_in_code(path: Path) -> list[tuple[int, str]]:
    """(line, text) for each string literal (docstrings aside) and identifier in PATH naming an engine:
    names, attributes, arguments, keywords, definitions and imported modules."""
    tree = ast.parse(path.read_text())
    docstrings = _docstring_nodes(tree)
    found = []
    for node in ast.walk(tree):
        texts = []
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            texts = [node.value]
        elif isinstance(node, ast.Name):
            texts = [node.id]
        elif isinstance(node, ast.Attribute):
            texts = [node.attr]
        elif isinstance(node, ast.arg):
            texts = [node.arg]
        elif isinstance(node, ast.keyword) and node.arg:
            texts = [node.arg]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            texts = [node.name]
        elif isinstance(node, ast.ImportFrom):
            texts = [node.module or "", *(a.name for a in node.names)]
        elif isinstance(node, ast.Import):
            texts = [a.name for a in node.names]
        found += [(getattr(node, "lineno", 0), t) for t in texts if ENGINE_NAMES.search(t)]
    return sorted(found)


def drafter_engine_names(root: Path = ROOT, exceptions=None) -> list[str]:
    """`file:line text` for each engine a drafter module outside the formats registry names in code."""
    exceptions = ENGINE_NAME_EXCEPTIONS if exceptions is None else exceptions
    out = []
    for path in sorted((root / "eagle3_assets" / "drafter").rglob("*.py")):
        rel = path.relative_to(root / "eagle3_assets").as_posix()
        if rel.startswith(FORMATS_PACKAGE) or "*" in exceptions.get(rel, {}):
            continue
        if ENGINE_NAMES.search(path.stem) and path.stem not in exceptions.get(rel, {}):
            out.append(f"{rel}:0 {path.stem}")
        out += [f"{rel}:{line} {text!r}" for line, text in engine_names_in_code(path)
                if text not in exceptions.get(rel, {})]
    return out


def test_no_drafter_module_outside_the_formats_registry_names_an_engine():
    """Each engine's export is its serving format's (``drafter/formats``); the rest of the stage asks the
    registry. Docstrings may name engines (they say why); code may not, save the listed exceptions."""
    named = drafter_engine_names()
    assert not named, "drafter modules naming an engine outside drafter/formats/:\n" + "\n".join(named)
    for rel, names in ENGINE_NAME_EXCEPTIONS.items():
        path = ROOT / "eagle3_assets" / rel
        used = {"*", path.stem} | {text for _, text in engine_names_in_code(path)}
        assert set(names) <= used, f"{rel}: exceptions no longer named: {sorted(set(names) - used)}"


def test_the_engine_name_rule_names_an_injected_branch(tmp_path):
    """The checker itself: a literal, an identifier and an import are named; a docstring and a
    module in the formats package are not."""
    drafter = tmp_path / "eagle3_assets" / "drafter"
    (drafter / "formats").mkdir(parents=True)
    (drafter / "formats" / "llama_sglang.py").write_text('ENGINE = "sglang"\n')
    (drafter / "export.py").write_text('"""Written for SGLang and vLLM."""\n'
                                       "from eagle3_assets.engines.vllm import roles\n\n\n"
                                       "def export(engine, export_vllm=None):\n"
                                       '    """For vLLM."""\n'
                                       '    return engine == "SGLang"\n')
    assert drafter_engine_names(tmp_path, exceptions={}) == [
        "drafter/export.py:2 'eagle3_assets.engines.vllm'", "drafter/export.py:5 'export_vllm'",
        "drafter/export.py:7 'SGLang'"]
