"""Generate the client's table of methods and their inputs from the service's registry.

    python clients/python/generate_methods.py           # rewrite advantage_client/methods.py
    python clients/python/generate_methods.py --check   # exit 1 when it differs from the registry

The client package installs without the service, yet the trainer integrations must know which
optional inputs (log-probs, entropies, teacher log-probs, ...) an estimator reads, so that a
trainer sends only those. The table is made from what ``GET /v1/estimators`` lists
(``advantage_service.wire.listing``), committed as a module of the client package, and
``tests/clients/test_methods_table.py`` fails when it drifts: a new method is added in one place,
the registry.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

TARGET = Path(__file__).resolve().parent / "advantage_client" / "methods.py"

HEADER = '''"""Generated from the service's estimator registry by
clients/python/generate_methods.py; do not edit. The methods the service had when this client
was released, and the optional inputs each reads (``teacher_logprobs``: any teacher condition).
"""

'''


def input_name(name: str) -> str:
    """``teacher_logprobs.pos`` -> ``teacher_logprobs``: the client sends all conditions."""
    return name.split(".", 1)[0]


def tuple_source(names: list[str], indent: int = 0) -> str:
    """A tuple of strings as ``ruff format`` writes it (one line if it fits in 100 columns)."""
    items = [json.dumps(n) for n in names]
    one_line = "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if indent + 30 + len(one_line) <= 100:
        return one_line
    pad = " " * (indent + 4)
    return "(\n" + "".join(f"{pad}{item},\n" for item in items) + " " * indent + ")"


def render(listing: dict[str, Any]) -> str:
    outcomes = [o["name"] for o in listing["outcomes"]]
    terms = [t["name"] for t in listing["terms"]]
    readers: dict[str, list[str]] = {}
    for component in (*listing["outcomes"], *listing["terms"]):
        for name in (*component["inputs"], *component["optional_inputs"]):
            readers.setdefault(input_name(name), [])
            if component["name"] not in readers[input_name(name)]:
                readers[input_name(name)].append(component["name"])
    lines = [HEADER]
    lines.append(f"OUTCOMES: tuple[str, ...] = {tuple_source(outcomes)}\n")
    lines.append(f"TERMS: tuple[str, ...] = {tuple_source(terms)}\n")
    lines.append(
        "# Optional input -> the outcomes and terms that read it (an estimator with none of them\n"
        "# is not sent that input).\n"
    )
    lines.append("INPUT_READERS: dict[str, tuple[str, ...]] = {\n")
    for name in sorted(readers):
        lines.append(f"    {json.dumps(name)}: {tuple_source(sorted(readers[name]), 4)},\n")
    lines.append("}\n")
    return "".join(lines)


def expected() -> str:
    from advantage_service.wire.listing import estimator_listing

    return render(estimator_listing())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    text = expected()
    if args.check:
        if TARGET.read_text() != text:
            print(f"{TARGET} drifted from the registry; run {Path(__file__).name}")
            return 1
        return 0
    TARGET.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
