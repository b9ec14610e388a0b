"""The contract is written once: each per-token input's name is in one hand-written definition
(``advantage_contract/fields.py``; generated files aside). (That the client distribution's
packages never import the service, not even inside a function: tests/test_import_rules.py.)"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from advantage_contract.fields import TOKEN_FIELDS

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [
    p
    for folder in (
        "service/advantage_service",
        "clients/python/advantage_client",
        "clients/python/advantage_contract",
    )
    for p in sorted((ROOT / folder).rglob("*.py"))
    if "grpc_gen" not in p.parts
]
FIELDS = "clients/python/advantage_contract/fields.py"
GENERATED = {ROOT / "clients/python/advantage_contract/methods.py"}


def tuples_of_names(path: Path) -> list[tuple[int, tuple[str, ...]]]:
    """Every tuple or list literal of two or more strings in ``path`` (line, names)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        strings = isinstance(node, ast.Tuple | ast.List) and all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts
        )
        if strings and len(node.elts) >= 2:  # type: ignore[attr-defined]
            found.append((node.lineno, tuple(e.value for e in node.elts)))  # type: ignore[attr-defined]
    return found


def test_the_per_token_inputs_are_listed_in_one_place() -> None:
    """A literal listing most of the per-token inputs is a second definition of them."""
    definitions = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in SOURCES
        if path not in GENERATED
        for line, names in tuples_of_names(path)
        if len(set(names) & set(TOKEN_FIELDS)) >= 4
    ]
    assert [d.split(":")[0] for d in definitions] == [FIELDS], definitions


def test_the_exact_integer_limit_is_written_once() -> None:
    written = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in SOURCES
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"=\s*2\s*\*\*\s*53\b", line)
    ]
    assert [w.split(":")[0] for w in written] == [FIELDS], written


def test_the_literal_scan_sees_a_list_of_inputs(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("data = ('logprobs', 'entropy', 'sum_pi_squared', 'is_weights')\n")
    assert tuples_of_names(module) == [(1, ("logprobs", "entropy", "sum_pi_squared", "is_weights"))]
