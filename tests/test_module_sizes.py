"""A module holds one idea a reader can keep in mind: every module of the service, the client
and the contract stays under 600 lines (generated modules aside). A file that grows past it is
split along a line a newcomer would guess (docs/architecture.md)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    ROOT / "service" / "advantage_service",
    ROOT / "clients" / "python" / "advantage_client",
    ROOT / "clients" / "python" / "advantage_contract",
)
LIMIT = 600


def lines_of(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_every_module_is_under_the_limit() -> None:
    modules = [
        p for package in PACKAGES for p in package.rglob("*.py") if "grpc_gen" not in p.parts
    ]
    assert len(modules) > 100
    over = {str(p.relative_to(ROOT)): lines_of(p) for p in modules if lines_of(p) >= LIMIT}
    assert over == {}, f"split these along one idea each: {over}"


def test_the_count_sees_a_long_module(tmp_path: Path) -> None:
    long = tmp_path / "long.py"
    long.write_text("x = 1\n" * LIMIT)
    assert lines_of(long) == LIMIT
