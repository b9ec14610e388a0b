"""Generate the Python gRPC modules from ``advantage/v1/advantage.proto`` (grpcio-tools).

    python proto/generate.py           # rewrite the committed copy
    python proto/generate.py --check   # exit 1 when the committed copy differs from the .proto

The generated modules are committed once, in the client package (``advantage_contract.grpc_gen``,
which the service imports too: the client installs without the server, the server depends on
the client), and ``tests/grpc/test_codegen.py`` fails when they drift from the .proto. protoc
writes ``from advantage.v1 import advantage_pb2``; the modules live in a flat package of their
own, so that import is made relative.
"""

from __future__ import annotations

import argparse
import difflib
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO = Path("advantage/v1/advantage.proto")
TARGET = ROOT / "clients/python/advantage_contract/grpc_gen"
MODULES = ("advantage_pb2.py", "advantage_pb2.pyi", "advantage_pb2_grpc.py")
ABSOLUTE_IMPORT = "from advantage.v1 import advantage_pb2 as"
RELATIVE_IMPORT = "from . import advantage_pb2 as"
INIT = '''"""Generated from proto/advantage/v1/advantage.proto by proto/generate.py; do not edit."""
'''


def generate(out: Path) -> dict[str, str]:
    """The generated modules (file name -> text), written under ``out``."""
    from grpc_tools import protoc  # a dev dependency: only generating needs it

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(PROTO_ROOT / PROTO),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO}")
        files = {"__init__.py": INIT}
        for name in MODULES:
            text = (Path(tmp) / PROTO.parent / name).read_text()
            files[name] = text.replace(ABSOLUTE_IMPORT, RELATIVE_IMPORT)
    for name, text in files.items():
        (out / name).write_text(text)
    return files


def drift(target: Path, expected: dict[str, str]) -> list[str]:
    """Unified diffs of every committed file that differs from ``expected`` (empty: none)."""
    diffs = []
    for name, text in expected.items():
        path = target / name
        current = path.read_text() if path.exists() else ""
        if current != text:
            diffs.append(
                "".join(
                    difflib.unified_diff(
                        current.splitlines(keepends=True),
                        text.splitlines(keepends=True),
                        f"{path} (committed)",
                        f"{path} (from {PROTO})",
                    )
                )
            )
    return diffs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        expected = generate(Path(tmp))
        if args.check:
            diffs = drift(TARGET, expected)
            for d in diffs:
                print(d)
            if diffs:
                print("generated code drifted from the .proto: run python proto/generate.py")
            return 1 if diffs else 0
        TARGET.mkdir(parents=True, exist_ok=True)
        for name in expected:
            shutil.copyfile(Path(tmp) / name, TARGET / name)
        print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
