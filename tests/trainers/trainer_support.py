"""A real service process for the trainer tests, and its request counter."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from process_support import ServiceProcess, launch_service


class TrainerService(ServiceProcess):
    """``advantage-service serve`` with an HTTP port (``url``) and a gRPC port (``target``)."""

    def __init__(self, proc: subprocess.Popen[bytes], http_port: int, grpc_port: int, log: Path):
        url = f"http://127.0.0.1:{http_port}"
        super().__init__(proc, url, log, httpx.Client(base_url=url, timeout=60.0))
        self.target = f"127.0.0.1:{grpc_port}"

    def also_ready(self) -> bool:
        with grpc.insecure_channel(self.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                answer = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
            except grpc.RpcError:
                return False
        return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)

    def requests(self, transport: str | None = None, estimator: str | None = None) -> float:
        """advantage_requests_total answered 200, summed over the labels not given."""
        total = 0.0
        for (name, labels), value in self.metrics().items():
            if name != "advantage_requests_total":
                continue
            found = dict(labels)
            if found.get("code") != "200":
                continue
            # (HTTP's label says the body format: http_arrow, http_json)
            if transport is not None and not found.get("transport", "").startswith(transport):
                continue
            if estimator is not None and found.get("estimator") != estimator:
                continue
            total += value
        return total


def start_trainer_service(directory: Path, **settings: Any) -> TrainerService:
    service = TrainerService(*launch_service(directory, settings))
    service.ready_or_killed()
    return service
