"""The Node.js example (clients/node/example.js) against the real service, and through a proxy
that refuses calls for overload first, as the service does when its queue is full."""

from __future__ import annotations

import itertools
import json
import math
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from advantage_contract.grpc_gen import advantage_pb2 as pb
from advantage_contract.grpc_gen import advantage_pb2_grpc as pb_grpc
from advantage_service import compute as compute_in_process
from service_support import Service

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


def run_example(node: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [node, "example.js", *args], cwd=NODE_DIR, capture_output=True, text=True, timeout=60
    )


def assert_prints_the_service_advantages(run: subprocess.CompletedProcess[str]) -> None:
    assert run.returncode == 0, run.stderr
    printed = json.loads(run.stdout)
    expected = compute_in_process(printed["request"], device="cpu")
    assert [g["id"] for g in printed["response"]["groups"]] == [g["id"] for g in expected["groups"]]
    for got, want in zip(printed["response"]["groups"], expected["groups"], strict=True):
        for r_got, r_want in zip(got["rollouts"], want["rollouts"], strict=True):
            np.testing.assert_allclose(r_got["advantages"], r_want["advantages"], rtol=1e-6)
            assert r_got["scalar"] == pytest.approx(r_want["scalar"], rel=1e-6)


def test_node_example_prints_the_advantages_the_service_computes(
    service: Service, node: str
) -> None:
    assert_prints_the_service_advantages(run_example(node, service.target, "--json"))


@pytest.mark.parametrize("estimator", ["otb", "forking"])
def test_node_example_sends_the_per_token_inputs_the_token_methods_need(
    service: Service, node: str, estimator: str
) -> None:
    run = run_example(node, service.target, "--json", f"--estimator={estimator}")
    assert_prints_the_service_advantages(run)
    printed = json.loads(run.stdout)
    assert printed["request"]["estimator"] == estimator
    # Both methods change the numbers: masked tokens, or a per-token baseline.
    ktae = json.loads(run_example(node, service.target, "--json").stdout)
    assert printed["response"] != ktae["response"]


def test_node_example_human_output_and_unreachable_target(service: Service, node: str) -> None:
    run = run_example(node, service.target)
    assert run.returncode == 0, run.stderr
    assert "prompt-1 rollout 0: scalar 0.7071, advantages [0.7071, 1.7071, 1.7071]" in run.stdout
    assert not run.stderr
    # Nothing listening is UNAVAILABLE too: retried with backoff, then given up.
    down = run_example(node, "127.0.0.1:1")
    assert down.returncode == 1 and "advantage-service:" in down.stderr
    assert down.stderr.count("advantage-service is unavailable") == 4, down.stderr
    assert "after 5 tries" in down.stderr


class RefusingProxy(pb_grpc.AdvantageServiceServicer):
    """Refuses the first ``refusals`` Compute calls as the service refuses for overload
    (UNAVAILABLE, ``advantage-error-code: overloaded``, ``retry-after`` and ``retry-after-ms``),
    then hands each call to the real service; records when each call arrived."""

    def __init__(self, upstream: str, refusals: int, retry_after_ms: int) -> None:
        self.channel = grpc.insecure_channel(upstream)
        self.upstream = pb_grpc.AdvantageServiceStub(self.channel)
        self.refusals = refusals
        self.retry_after_ms = retry_after_ms
        self.arrivals: list[float] = []
        self.lock = threading.Lock()

    def Compute(self, request: pb.ComputeRequest, context: Any) -> pb.ComputeResponse:
        with self.lock:
            self.arrivals.append(time.monotonic())
            refuse = len(self.arrivals) <= self.refusals
        if refuse:
            context.set_trailing_metadata(
                (
                    ("advantage-error-code", "overloaded"),
                    ("advantage-field-bin", b"queue"),
                    ("retry-after", str(max(1, math.ceil(self.retry_after_ms / 1000)))),
                    ("retry-after-ms", str(self.retry_after_ms)),
                )
            )
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"the service holds 256 requests (ADV_MAX_QUEUE): retry after "
                f"{self.retry_after_ms} ms",
            )
        response: pb.ComputeResponse = self.upstream.Compute(request, timeout=30)
        return response

    def gaps(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.arrivals)]


@pytest.fixture
def proxy(service: Service, request: pytest.FixtureRequest) -> Iterator[tuple[RefusingProxy, str]]:
    refusals, retry_after_ms = request.param
    servicer = RefusingProxy(service.target, refusals, retry_after_ms)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_AdvantageServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(None)
        servicer.channel.close()


@pytest.mark.parametrize("proxy", [(2, 300)], indirect=True)
def test_node_example_retries_overload_refusals_after_retry_after_ms(
    proxy: tuple[RefusingProxy, str], node: str
) -> None:
    servicer, target = proxy
    run = run_example(node, target, "--json")
    assert_prints_the_service_advantages(run)
    assert run.stderr.count("advantage-service is overloaded") == 2, run.stderr
    assert "retrying in" in run.stderr and "(retry 2 of 4)" in run.stderr, run.stderr
    assert len(servicer.arrivals) == 3
    for gap in servicer.gaps():
        # 300 ms plus jitter: the millisecond hint, not the second of retry-after.
        assert 0.3 <= gap < 0.9, servicer.gaps()


@pytest.mark.parametrize("proxy", [(100, 20)], indirect=True)
def test_node_example_gives_up_on_a_lasting_overload(
    proxy: tuple[RefusingProxy, str], node: str
) -> None:
    servicer, target = proxy
    run = run_example(node, target)
    assert run.returncode == 1, run.stdout
    assert run.stderr.count("retrying in") == 4, run.stderr
    assert "advantage-service: the service holds 256 requests" in run.stderr
    assert "(overloaded) after 5 tries" in run.stderr, run.stderr
    assert len(servicer.arrivals) == 5
