"""The committed generated modules are what grpcio-tools makes of the .proto today."""

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


def test_generated_modules_match_the_proto_in_server_and_client(tmp_path: Path) -> None:
    generate = load_generator()
    expected = generate.generate(tmp_path / "generated")
    assert set(expected) == {"__init__.py", *generate.MODULES}
    assert len(generate.TARGETS) == 2
    for target in generate.TARGETS:
        diffs = generate.drift(target, expected)
        assert not diffs, (
            f"{target} drifted from proto/advantage/v1/advantage.proto; run "
            "`python proto/generate.py`:\n" + "\n".join(diffs)[:4000]
        )


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


def test_server_and_client_share_one_descriptor() -> None:
    from advantage_client.grpc_gen import advantage_pb2 as client_pb
    from advantage_service.transports.grpc_gen import advantage_pb2 as server_pb

    assert server_pb.DESCRIPTOR.name == "advantage/v1/advantage.proto"
    assert client_pb.DESCRIPTOR.serialized_pb == server_pb.DESCRIPTOR.serialized_pb
