"""The layers know what they should and nothing more, read from the package's syntax trees.

- No layer above the estimators names a term that keeps state: the state protocol
  (``estimators/state.py``) is the only seam. Every module of ``serving/`` (the engine among
  them), ``wire/`` and ``observability/``, the modules at the package's top level (``cli.py`` and
  ``config.py`` aside: their help texts describe the settings), ``estimators/pipeline.py``,
  ``estimators/registry.py`` and everything under ``stats/`` hold no identifier and no string
  (docstrings and comments aside) that names KTAE.
- ``stats/`` imports nothing from ``estimators`` or ``request``: it stores opaque records and
  column sums.
"""

from __future__ import annotations

import ast
from pathlib import Path

import advantage_service
import pytest

PACKAGE = Path(advantage_service.__file__).resolve().parent
TOP_LEVEL_EXEMPT = {"cli.py", "config.py"}


def term_blind_modules() -> list[Path]:
    top = [p for p in sorted(PACKAGE.glob("*.py")) if p.name not in TOP_LEVEL_EXEMPT]
    folders = [
        p for f in ("serving", "wire", "observability") for p in sorted((PACKAGE / f).glob("*.py"))
    ]
    estimators = [PACKAGE / "estimators" / "pipeline.py", PACKAGE / "estimators" / "registry.py"]
    return top + folders + estimators + sorted((PACKAGE / "stats").glob("*.py"))


def docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (of the module, classes, functions)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                out.add(id(first.value))
    return out


def names_in(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of every identifier and non-doc string of ``tree``."""
    skip = docstrings(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Name):
            found.append((line, node.id))
        elif isinstance(node, ast.Attribute):
            found.append((line, node.attr))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.append((line, node.name))
        elif isinstance(node, ast.arg) or (isinstance(node, ast.keyword) and node.arg is not None):
            found.append((line, node.arg))
        elif isinstance(node, ast.alias):
            found.append((line, node.name))
            if node.asname:
                found.append((line, node.asname))
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((line, node.module))
        elif (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
        ):
            found.append((line, node.value))
    return found


def ktae_mentions(source: str) -> list[tuple[int, str]]:
    return [(line, text) for line, text in names_in(ast.parse(source)) if "ktae" in text.lower()]


def forbidden_imports(source: str) -> list[tuple[int, str]]:
    """Imports of the estimators or of the request module (relative or absolute)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        modules = []
        if isinstance(node, ast.ImportFrom):
            base = ("." * node.level) + (node.module or "")
            sep = "." if node.module else ""
            modules = [base] + [f"{base}{sep}{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        for module in modules:
            parts = module.lstrip(".").split(".")
            if "estimators" in parts or "request" in parts:
                out.append((node.lineno, module))
    return out


@pytest.mark.parametrize("path", term_blind_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_layer_above_the_estimators_names_the_key_token_term(path: Path) -> None:
    assert ktae_mentions(path.read_text()) == []


@pytest.mark.parametrize("path", sorted((PACKAGE / "stats").glob("*.py")), ids=lambda p: p.name)
def test_the_stats_store_imports_neither_estimators_nor_requests(path: Path) -> None:
    assert forbidden_imports(path.read_text()) == []


def test_the_checks_find_what_they_look_for() -> None:
    """The walkers see identifiers, attributes, keywords, imports and strings, and skip only
    docstrings: without this a check that finds nothing would pass for the wrong reason."""
    source = '''"""KTAE in a docstring is fine."""
from ..estimators.ktae import tabulate
from .. import request
import advantage_service.estimators


def f(ctx, *, ktae_prior=None):
    """Docstrings may say KTAE."""
    ctx.collect_ktae_tables = True
    g(ktae=1)
    return ctx.terms.get("ktae")
'''
    mentions = {text for _, text in ktae_mentions(source)}
    assert mentions == {
        "estimators.ktae",
        "ktae_prior",
        "collect_ktae_tables",
        "ktae",
    }
    assert [line for line, _ in ktae_mentions(source)].count(11) == 1  # the string literal
    assert {m for _, m in forbidden_imports(source)} >= {
        "..estimators.ktae",
        "..request",
        "advantage_service.estimators",
    }
    assert term_blind_modules() and all(p.exists() for p in term_blind_modules())
