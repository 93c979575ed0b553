"""The package's imports run one way, with the data (docs/design.md's rules of the imports):
no subpackage imports against the flow, and no cycle, between subpackages or between modules.

Every `import` and `from … import` in nanoserve/ is read with `ast`, function-local ones too (a
cycle hidden inside a function is still a cycle), and mapped to the subpackage it comes from and
the one it reaches. Top-level modules (`protocol.py`, `config.py`, `sampling_params.py`, ...)
count as their own part.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "nanoserve"

# (importer, imported) pairs that must never appear
FORBIDDEN = {
    ("sample", "engine"), ("output", "engine"), ("model", "engine"), ("model", "sample"),
    ("engine", "entrypoints"), ("engine", "output"),
    # structured outputs sit beside sample/ and model/: the engine and the entry points use
    # them; they use neither, nor each other
    ("structured", "engine"), ("structured", "entrypoints"), ("structured", "output"),
    ("structured", "sample"), ("sample", "structured"),
    ("structured", "model"), ("model", "structured"),
    # the chat parsers read text and emit neutral events: no wire format, no engine; the
    # output path (detokenize, stop strings) is beside them, not below or above
    ("parsers", "entrypoints"), ("parsers", "engine"), ("parsers", "output"),
    ("parsers", "model"), ("parsers", "sample"), ("output", "parsers"),
    # the draft proposers read committed token ids (sample/sequence.py's data); the engine
    # asks them, never the other way
    ("spec", "engine"), ("spec", "entrypoints"), ("spec", "output"), ("spec", "model"),
    ("spec", "structured"), ("sample", "spec"), ("model", "spec"),
    # the kernel tuner times the model's own weights and sets the kernels' schedule: the engine
    # and the benchmarks call it; it reaches neither, and the model never asks it
    ("kernel_tuning", "engine"), ("kernel_tuning", "entrypoints"), ("kernel_tuning", "bench"),
    ("model", "kernel_tuning"), ("sample", "kernel_tuning"), ("structured", "kernel_tuning"),
}


def _part(module: str) -> str | None:
    """'nanoserve.sample.state' -> 'sample'; 'nanoserve.protocol' -> 'protocol'."""
    names = module.split(".")
    if names[0] != "nanoserve" or len(names) < 2:
        return None
    return names[1]


def _module_name(path: Path, package_dir: Path = PACKAGE_DIR) -> str:
    relative = path.relative_to(package_dir.parent).with_suffix("")
    names = list(relative.parts)
    if names[-1] == "__init__":
        names.pop()
    return ".".join(names)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module that `source` (the text of `module`) imports, at any depth."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.add(".".join([*base, node.module] if node.module else base))
            elif node.module:
                found.add(node.module)
    return found


def part_edges() -> dict[tuple[str, str], list[str]]:
    """(importer part, imported part) -> the files where such an import is written."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        source = _part(_module_name(path)) or "__init__"
        imports = imported_modules(path.read_text(), _module_name(path),
                                   is_package=path.name == "__init__.py")
        for imported in imports:
            target = _part(imported)
            if target is not None and target != source:
                edges.setdefault((source, target), []).append(str(path.relative_to(PACKAGE_DIR)))
    return edges


def find_cycle(edges: set[tuple[str, str]]) -> list[str] | None:
    """One cycle in the directed graph as a path of nodes, or None."""
    graph: dict[str, set[str]] = {}
    for source, target in edges:
        graph.setdefault(source, set()).add(target)
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_no_import_runs_against_the_data_flow() -> None:
    edges = part_edges()
    broken = {pair: files for pair, files in edges.items() if pair in FORBIDDEN}
    assert not broken, "imports against the data flow: " + "; ".join(
        f"{a} -> {b} in {', '.join(files)}" for (a, b), files in sorted(broken.items()))


def test_no_import_cycle_between_subpackages() -> None:
    # The package's own __init__ re-exports the public API; it is the top, not a part.
    edges = {pair for pair in part_edges() if "__init__" not in pair}
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle between parts: " + " -> ".join(cycle or [])


def module_edges(package_dir: Path = PACKAGE_DIR) -> set[tuple[str, str]]:
    """(importer, imported) between the package's own modules: every import at any depth
    (inside a function or under TYPE_CHECKING too); `from package import name` reaches the
    submodule `package.name` where there is one."""
    modules = {_module_name(path, package_dir): path
               for path in sorted(package_dir.rglob("*.py"))}
    edges: set[tuple[str, str]] = set()
    for module, path in modules.items():
        source = path.read_text()
        is_package = path.name == "__init__.py"
        found = imported_modules(source, module, is_package)
        package = module if is_package else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base
                                                                              else []))
                found.update(f"{base}.{alias.name}" for alias in node.names)
        edges.update((module, target) for target in found
                     if target in modules and target != module)
    return edges


def test_no_import_cycle_between_modules() -> None:
    """A cycle inside a subpackage is still a cycle: its modules cannot be read, tested or
    replaced one at a time."""
    cycle = find_cycle(module_edges())
    assert cycle is None, "import cycle between modules: " + " -> ".join(cycle or [])


def test_a_module_cycle_made_on_purpose_is_found(tmp_path: Path) -> None:
    """Two modules of a package that import each other, one only for types."""
    package = tmp_path / "nanoserve" / "part"
    package.mkdir(parents=True)
    (tmp_path / "nanoserve" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from nanoserve.part.b import B\n")
    (package / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                  "    from . import a\nclass B: ...\n")
    (package / "c.py").write_text("from nanoserve.part import b\n")
    edges = module_edges(tmp_path / "nanoserve")
    assert ("nanoserve.part.c", "nanoserve.part.b") in edges
    assert find_cycle(edges) in (["nanoserve.part.a", "nanoserve.part.b", "nanoserve.part.a"],
                                 ["nanoserve.part.b", "nanoserve.part.a", "nanoserve.part.b"])


@pytest.mark.parametrize(("edges", "has_cycle"), [
    ({("a", "b"), ("b", "c")}, False),
    ({("a", "b"), ("b", "c"), ("c", "a")}, True),
    ({("a", "b"), ("b", "a")}, True),
])
def test_cycle_finder(edges: set[tuple[str, str]], has_cycle: bool) -> None:
    assert (find_cycle(edges) is not None) is has_cycle


def test_walker_sees_function_local_and_relative_imports() -> None:
    source = ("import torch\n"
              "def f():\n    from nanoserve.engine.core import EngineCore\n"
              "from . import stages\nfrom ..protocol import EngineCoreOutput\n")
    found = imported_modules(source, "nanoserve.sample.probe")
    assert found == {"torch", "nanoserve.engine.core", "nanoserve.sample",
                     "nanoserve.protocol"}


# The worker's side of the executor seam: what one rank runs never reaches the scheduler or a
# live `Request`, at any depth, so a step can be sent to another process as data.
WORKER_SIDE = ("nanoserve.engine.worker", "nanoserve.engine.executor",
               "nanoserve.engine.model_runner", "nanoserve.engine.zero_cost_runner",
               "nanoserve.engine.rank_build", "nanoserve.engine.tp_worker")
SCHEDULER_SIDE = {"nanoserve.engine.scheduler", "nanoserve.engine.request",
                  "nanoserve.engine.core", "nanoserve.engine.kv_cache"}


def _reachable(start: str) -> set[str]:
    """Every nanoserve module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = PACKAGE_DIR.parent / (module.replace(".", "/") + ".py")
        is_package = not path.exists()
        if is_package:
            path = path.with_suffix("") / "__init__.py"
        if not path.exists():
            continue
        source = path.read_text()
        found = imported_modules(source, module, is_package)
        # `from nanoserve.model import attention` imports the submodule too
        found |= {f"{node.module}.{alias.name}" for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.ImportFrom) and node.module and not node.level
                  for alias in node.names}
        todo += [m for m in found if m.startswith("nanoserve.")]
    return seen


def test_reachable_follows_imports_at_any_depth() -> None:
    reached = _reachable("nanoserve.engine.core")
    assert {"nanoserve.engine.scheduler", "nanoserve.engine.request",
            "nanoserve.sample.sampler"} <= reached


@pytest.mark.parametrize("module", WORKER_SIDE)
def test_the_worker_side_never_reaches_the_scheduler(module: str) -> None:
    reached = _reachable(module) & SCHEDULER_SIDE
    assert not reached, f"{module} imports {sorted(reached)}"


def test_the_model_never_reaches_the_engine() -> None:
    for path in sorted((PACKAGE_DIR / "model").rglob("*.py")):
        module = _module_name(path)
        reached = {m for m in _reachable(module) if m.startswith("nanoserve.engine")}
        assert not reached, f"{module} imports {sorted(reached)}"
