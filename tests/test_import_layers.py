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


# entrypoints/: each folder a part of its own, the files directly in it one part more, the top
# floor (the command line and the app, which may import every folder and which no folder
# imports); serving/ is the pipeline every wire format stands on and imports none of them.
TOP_FLOOR = "entrypoints"
WIRE_FORMATS = ("openai", "responses", "anthropic", "ollama")


def entrypoint_part(module: str) -> str | None:
    """'nanoserve.entrypoints.openai.routes' -> 'openai'; a module directly in entrypoints/ ->
    the top floor; None outside entrypoints/."""
    names = module.split(".")
    if names[:2] != ["nanoserve", "entrypoints"] or len(names) < 3:
        return None
    return TOP_FLOOR if len(names) == 3 else names[2]


def entrypoint_edges(package_dir: Path = PACKAGE_DIR) -> dict[tuple[str, str], list[str]]:
    """(importer part, imported part) within entrypoints/, each with the files that import."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted((package_dir / "entrypoints").rglob("*.py")):
        module = _module_name(path, package_dir)
        if path.name == "__init__.py" and module.count(".") <= 2:
            continue  # a folder's own (empty) __init__ is no import of anything
        source_part = entrypoint_part(module)
        for imported in imported_modules(path.read_text(), module, path.name == "__init__.py"):
            target = entrypoint_part(imported)
            if source_part and target and target != source_part:
                edges.setdefault((source_part, target), []).append(
                    str(path.relative_to(package_dir)))
    return edges


def entrypoint_violations(edges: dict[tuple[str, str], list[str]]) -> list[str]:
    """Every arrow into the top floor, every arrow from serving/ up into a wire format, and a
    loop between parts, described."""
    found = [f"{a} -> {b} ({', '.join(files)})" for (a, b), files in sorted(edges.items())
             if b == TOP_FLOOR or (a == "serving" and b in WIRE_FORMATS)]
    cycle = find_cycle(set(edges))
    if cycle:
        found.append("a loop: " + " -> ".join(cycle))
    return found


def test_the_entrypoints_floors_hold() -> None:
    assert entrypoint_violations(entrypoint_edges()) == []
    edges = entrypoint_edges()
    assert ("openai", "serving") in edges and ("anthropic", "serving") in edges


def test_an_arrow_from_serving_up_into_a_wire_format_is_found(tmp_path: Path) -> None:
    """A tree made on purpose: serving/ reaching up into openai/, and a folder reaching the
    top floor; the real tree's check must catch both."""
    root = tmp_path / "nanoserve"
    for folder in ("entrypoints/serving", "entrypoints/openai"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "entrypoints" / "__init__.py").write_text("")
    (root / "entrypoints" / "app.py").write_text(
        "from nanoserve.entrypoints.openai.routes import add\n")
    (root / "entrypoints" / "openai" / "routes.py").write_text(
        "from nanoserve.entrypoints.serving.prepare import prepare\nadd = prepare\n")
    (root / "entrypoints" / "serving" / "prepare.py").write_text(
        "def prepare(): ...\n")
    assert entrypoint_violations(entrypoint_edges(root)) == []
    (root / "entrypoints" / "serving" / "prepare.py").write_text(
        "from nanoserve.entrypoints.openai.protocol import Body\ndef prepare(): ...\n")
    (root / "entrypoints" / "openai" / "protocol.py").write_text("class Body: ...\n")
    (root / "entrypoints" / "openai" / "bad.py").write_text(
        "def f():\n    from nanoserve.entrypoints.app import add\n")
    found = entrypoint_violations(entrypoint_edges(root))
    assert any(v.startswith("serving -> openai") for v in found)
    assert any(v.startswith(f"openai -> {TOP_FLOOR}") for v in found)
    assert any(v.startswith("a loop:") for v in found)
