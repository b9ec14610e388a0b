"""A real service process with both transports (``advantage-service serve``: HTTP and gRPC on
one engine), for the test folders that talk to it over both: ready when its HTTP side is and its
gRPC health service says SERVING."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Self

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from process_support import ServiceProcess, launch_service


def health_status(target: str, service: str = "") -> int | None:
    """The gRPC health service's answer for ``service`` (None when unreachable)."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status)
        except grpc.RpcError:
            return None


class Service(ServiceProcess):
    """One running service process with an HTTP port (``url``) and a gRPC port (``target``)."""

    def __init__(self, proc: subprocess.Popen[bytes], http_port: int, grpc_port: int, log: Path):
        url = f"http://127.0.0.1:{http_port}"
        super().__init__(proc, url, log, httpx.Client(base_url=url, timeout=60.0))
        self.target = f"127.0.0.1:{grpc_port}"

    def also_ready(self) -> bool:
        return health_status(self.target) == health_pb2.HealthCheckResponse.SERVING

    @classmethod
    def start(cls, directory: Path, **settings: Any) -> Self:
        """One on free ports, with ``ADV_<NAME>`` variables from ``settings``, on the CPU,
        once it is ready (killed if it never is)."""
        service = cls(*launch_service(directory, settings))
        service.ready_or_killed()
        return service
