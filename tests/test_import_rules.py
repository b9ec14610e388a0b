"""The package's folders are layers: a module imports only from its own layer or the ones below,
and no two modules import each other, directly or around a circle.

Every import counts: at the top of a module, inside a function, under ``TYPE_CHECKING``. The
layers (lowest first) are the table below; docs/architecture.md draws the same picture. A module
the table does not place fails the test, so a new folder or module must be placed on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

import advantage_service
import pytest

PACKAGE = Path(advantage_service.__file__).resolve().parent
ROOT = PACKAGE.name

# Folder (or top-level module) -> layer. Lower layers never import higher ones.
LAYERS: dict[str, int] = {
    "arenas": 0,  # (the process's malloc arenas, capped by ``serve``: imports nothing)
    "errors": 0,
    "version": 0,
    "batch": 1,
    "observability": 1,
    "stats": 1,
    "estimators": 2,
    "config": 3,
    "wire": 3,
    "serving": 4,
    "viewer": 5,
    "transports": 6,
    # The public face: what users import and run.
    "api": 7,
    "cli": 7,
    "__main__": 7,
    "": 7,  # the package's __init__
}


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = [package.name, *path.relative_to(package).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules that ``source`` (module ``module``) imports, wherever the import
    stands. ``from X import name`` counts X.name when that is a module (a submodule taken from its
    package), else X."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                targets.append(sub if sub in known else target)
        elif isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
        out.update(t for t in targets if t in known and t != module)
    return out


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    paths = {module_name(p, package): p for p in package.rglob("*.py")}
    known = set(paths)
    return {
        name: imports_of(path.read_text(), name, path.name == "__init__.py", known)
        for name, path in paths.items()
    }


def layer_of(module: str) -> int:
    head = module.split(".")[1] if "." in module else ""
    if head not in LAYERS:
        raise KeyError(f"{module} is in no layer: place {head!r} in LAYERS")
    return LAYERS[head]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
        for m, targets in graph.items()
        for t in targets
        if layer_of(t) > layer_of(m)
    )


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_init_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph without a package's ``__init__`` importing its own submodules: that is how a
    package gathers its names, and a submodule reaching a sibling through the package (``from
    . import registry``) is not a circle between two modules."""
    return {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}


GRAPH = import_graph()


def test_every_module_is_placed_in_a_layer() -> None:
    for module in GRAPH:
        layer_of(module)


def test_no_module_imports_from_a_higher_layer() -> None:
    assert upward_imports(GRAPH) == []


def test_no_two_modules_import_each_other() -> None:
    assert cycles(package_init_edges(GRAPH)) == []


def test_at_most_eight_modules_stay_at_the_top_of_the_package() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 8, top


def test_the_walker_finds_every_kind_of_import(tmp_path: Path) -> None:
    """Imports at the top, in functions and under TYPE_CHECKING are all seen, and a circle and
    an upward import in a made-up package are reported: without this the checks above could
    pass for finding nothing."""
    pkg = tmp_path / ROOT
    for folder in ("serving", "wire", "transports"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "wire" / "codec.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from ..serving.engine import Engine\n"
    )
    (pkg / "serving" / "engine.py").write_text(
        "def f():\n    from ..wire import codec\n    from .. import errors\n"
    )
    (pkg / "transports" / "a.py").write_text("import advantage_service.transports.b\n")
    (pkg / "transports" / "b.py").write_text("from . import a\n")
    graph = import_graph(pkg)
    assert graph[f"{ROOT}.wire.codec"] == {f"{ROOT}.serving.engine"}
    assert graph[f"{ROOT}.serving.engine"] == {f"{ROOT}.wire.codec", f"{ROOT}.errors"}
    assert upward_imports(graph) == [
        f"{ROOT}.wire.codec (layer 3) imports {ROOT}.serving.engine (layer 4)"
    ]
    assert sorted(cycles(package_init_edges(graph))) == [
        [f"{ROOT}.serving.engine", f"{ROOT}.wire.codec"],
        [f"{ROOT}.transports.a", f"{ROOT}.transports.b"],
    ]
    (pkg / "newfolder").mkdir()
    (pkg / "newfolder" / "x.py").write_text("")
    with pytest.raises(KeyError, match="newfolder"):
        layer_of(f"{ROOT}.newfolder.x")


# ---- the three packages -------------------------------------------------------------------------

SOURCES = PACKAGE.parent.parent  # the repository
PACKAGES = {
    "advantage_contract": SOURCES / "clients" / "python" / "advantage_contract",
    "advantage_client": SOURCES / "clients" / "python" / "advantage_client",
    "advantage_service": PACKAGE,
}
# Package -> the others it may import. The contract is read by both sides and imports neither;
# the client never imports the service (its in-process transport is an entry point).
MAY_IMPORT = {
    "advantage_contract": set(),
    "advantage_client": {"advantage_contract"},
    "advantage_service": {"advantage_contract"},
}


def packages_imported(folder: Path) -> dict[str, set[str]]:
    """Module path -> the project's packages it imports, wherever the import stands."""
    out: dict[str, set[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found.add(node.module.split(".")[0])
        out[str(path.relative_to(folder.parent))] = found & set(PACKAGES)
    return out


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_each_package_imports_only_the_packages_it_may(package: str) -> None:
    allowed = MAY_IMPORT[package] | {package}
    wrong = {
        module: sorted(imported - allowed)
        for module, imported in packages_imported(PACKAGES[package]).items()
        if imported - allowed
    }
    assert wrong == {}


def test_the_package_walker_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    folder = tmp_path / "advantage_client"
    folder.mkdir()
    (folder / "lazy.py").write_text("def f():\n    import advantage_service.api\n")
    assert packages_imported(folder) == {"advantage_client/lazy.py": {"advantage_service"}}
