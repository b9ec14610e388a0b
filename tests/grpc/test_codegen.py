"""The committed generated modules (one copy, in the client package) are what grpcio-tools
makes of the .proto today."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_generator():
    import grpc_tools  # noqa: F401  (the dev extra; a missing generator must fail, not skip)

    spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "proto" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_generated_modules_match_the_proto(tmp_path: Path) -> None:
    generate = load_generator()
    expected = generate.generate(tmp_path / "generated")
    assert set(expected) == {"__init__.py", *generate.MODULES}
    diffs = generate.drift(generate.TARGET, expected)
    assert not diffs, (
        f"{generate.TARGET} drifted from proto/advantage/v1/advantage.proto; run "
        "`python proto/generate.py`:\n" + "\n".join(diffs)[:4000]
    )


def test_the_generated_modules_are_committed_once_in_the_client_package() -> None:
    generate = load_generator()
    assert generate.TARGET == ROOT / "clients/python/advantage_contract/grpc_gen"
    copies = [
        p.parent
        for top in ("service", "clients", "bench", "tests")
        for p in (ROOT / top).glob("**/advantage_pb2.py")
    ]
    assert copies == [generate.TARGET]


def test_drift_check_notices_an_edited_module(tmp_path: Path) -> None:
    generate = load_generator()
    expected = generate.generate(tmp_path / "generated")
    edited = tmp_path / "edited"
    edited.mkdir()
    for name, text in expected.items():
        (edited / name).write_text(text)
    (edited / "advantage_pb2_grpc.py").write_text(expected["advantage_pb2_grpc.py"] + "# edit\n")
    diffs = generate.drift(edited, expected)
    assert len(diffs) == 1 and "advantage_pb2_grpc.py" in diffs[0]


def test_the_service_speaks_the_client_packages_messages() -> None:
    from advantage_contract.grpc_gen import advantage_pb2, advantage_pb2_grpc
    from advantage_service.transports import grpc, grpc_codec, grpc_stream

    assert advantage_pb2.DESCRIPTOR.name == "advantage/v1/advantage.proto"
    assert grpc_codec.pb is advantage_pb2 and grpc_stream.pb is advantage_pb2
    assert grpc.pb is advantage_pb2 and grpc.pb_grpc is advantage_pb2_grpc
