"""The documents' settings tables (a ``| variable | flag | default |`` header) say what the
settings object holds: each ``ADV_*`` name is a setting, its ``serve`` flag is the one the CLI
builds for it, and its default is the field's. The tables are kept by hand beside the prose that
explains them; this is what keeps them from drifting (a default of 300 s stood in two documents
for a setting whose default was 60)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from advantage_service.cli import build_parser
from advantage_service.config import Settings

ROOT = Path(__file__).resolve().parents[1]
HEADER = "| variable | flag | default |"
# A default that says the setting has none of its own (None in the settings object).
UNSET = ("unset", "= the deadline")


def rows() -> list[tuple[str, int, list[str], list[str], str]]:
    """(document, line, names, flags, default cell) of every settings table's rows."""
    found = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        inside = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith(HEADER):
                inside = True
                continue
            if not line.startswith("|"):
                inside = False
            if inside and not line.startswith("|---"):
                name_cell, flag_cell, default_cell = (
                    c.strip() for c in line.strip("|").split("|")[:3]
                )
                names = re.findall(r"`(ADV_\w+)`", name_cell)
                flags = re.findall(r"`(--[\w-]+)`", flag_cell)
                found.append((path.name, number, names, flags, default_cell))
    return found


def serve_flags() -> dict[str, str]:
    """The setting each of ``serve``'s flags sets."""
    parser = build_parser()
    serve = next(
        sub
        for action in parser._subparsers._group_actions  # type: ignore[union-attr]
        for name, sub in action.choices.items()
        if name == "serve"
    )
    return {flag: action.dest for action in serve._actions for flag in action.option_strings}


def documented(cell: str) -> Any:
    """A default as a table writes it: ``unset`` (None), a number with thousands commas, or a
    literal in backticks; a note in parentheses after it is the reader's."""
    text = re.sub(r"\s*\(.*\)$", "", cell).strip("`")
    if text in UNSET:
        return None
    number = text.replace(",", "")
    if re.fullmatch(r"-?\d+(\.\d+)?", number):
        return float(number)
    return text


def test_every_settings_table_is_found_and_http_md_lists_every_setting() -> None:
    documents = {document for document, *_ in rows()}
    assert documents == {"http.md", "reliability.md"}, documents
    listed = {
        name.removeprefix("ADV_").lower()
        for document, _, names, _, _ in rows()
        if document == "http.md"
        for name in names
    }
    assert listed == set(Settings.model_fields), set(Settings.model_fields) ^ listed


@pytest.mark.parametrize(("document", "line", "names", "flags", "cell"), rows())
def test_a_rows_names_flags_and_defaults_are_the_settings(
    document: str, line: int, names: list[str], flags: list[str], cell: str
) -> None:
    where = f"docs/{document}:{line}"
    fields = Settings.model_fields
    settings = [name.removeprefix("ADV_").lower() for name in names]
    assert names and all(s in fields for s in settings), f"{where}: {names} not all settings"
    by_flag = serve_flags()
    assert [by_flag.get(flag) for flag in flags] == settings, (
        f"{where}: the flags {flags} are not `serve`'s for {names}"
    )
    # One default per name, in order ("65,536, 5": a comma and a blank part them).
    cells = cell.split(", ") if len(names) > 1 and cell not in UNSET else [cell] * len(names)
    assert len(cells) == len(names), f"{where}: {cell!r} for {names}"
    for name, setting, text in zip(names, settings, cells, strict=True):
        default = fields[setting].default
        expected = float(default) if isinstance(default, int | float) else default
        if default == ():  # (no ids: documented as unset)
            expected = None
        if isinstance(expected, str):
            expected = expected.lower()
        assert documented(text) == expected, f"{where}: {name} default {text!r}, is {default!r}"
