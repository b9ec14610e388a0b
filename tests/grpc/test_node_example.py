"""The Node.js example (clients/node/example.js) against the real service."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from advantage_service import compute as compute_in_process
from grpc_support import Service

pytestmark = pytest.mark.integration

NODE_DIR = Path(__file__).resolve().parents[2] / "clients" / "node"


@pytest.fixture(scope="module")
def node() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the Node.js gRPC example (clients/node) is not run")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        npm = shutil.which("npm")
        assert npm is not None, "node is installed but npm is not: cannot install clients/node"
        install = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"],
            cwd=NODE_DIR,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert install.returncode == 0, f"npm ci failed:\n{install.stdout}\n{install.stderr}"
    return node


def test_node_example_prints_the_advantages_the_service_computes(
    service: Service, node: str
) -> None:
    run = subprocess.run(
        [node, "example.js", service.target, "--json"],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    printed = json.loads(run.stdout)
    expected = compute_in_process(printed["request"], device="cpu")
    assert [g["id"] for g in printed["response"]["groups"]] == [g["id"] for g in expected["groups"]]
    for got, want in zip(printed["response"]["groups"], expected["groups"], strict=True):
        for r_got, r_want in zip(got["rollouts"], want["rollouts"], strict=True):
            np.testing.assert_allclose(r_got["advantages"], r_want["advantages"], rtol=1e-6)
            assert r_got["scalar"] == pytest.approx(r_want["scalar"], rel=1e-6)


def test_node_example_human_output_and_unreachable_target(service: Service, node: str) -> None:
    run = subprocess.run(
        [node, "example.js", service.target],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert "prompt-1 rollout 0: scalar 0.7071, advantages [0.7071, 1.7071, 1.7071]" in run.stdout
    down = subprocess.run(
        [node, "example.js", "127.0.0.1:1"],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert down.returncode == 1 and "advantage-service:" in down.stderr
