"""A scripted ``advantage.v1.AdvantageService`` servicer served in this process, for the client
tests that need a gRPC server's answers but no service process."""

from __future__ import annotations

from concurrent import futures

import grpc
from advantage_contract.grpc_gen import advantage_pb2_grpc as pb_grpc


def serve(servicer: pb_grpc.AdvantageServiceServicer) -> tuple[grpc.Server, str]:
    """``servicer`` on a free loopback port: (the started server, its ``host:port``)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_AdvantageServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"
