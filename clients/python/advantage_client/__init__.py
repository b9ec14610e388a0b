"""Clients of the advantage service: per-token advantages for groups of rollouts.

- :class:`HttpClient` (``POST /v1/advantages``, Arrow IPC on the wire by default) and
  :class:`GrpcClient` (``advantage.v1.AdvantageService``): ``.compute(request) -> response``,
  the service's JSON request and response as dicts, per-token arrays as numpy float32.
- :meth:`GrpcClient.stream`: rollouts in as they finish, each group's result out as soon as
  the group is complete.
- :func:`to_padded`: results as the (batch, max_len) right-padded arrays trainers use.

Light on purpose: numpy, httpx, grpcio, protobuf and pyarrow; no torch. The two clients are
imported on first use, so the service, which shares :mod:`advantage_contract.flat` and
:mod:`advantage_contract.grpc_gen`, does not load httpx with them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from advantage_contract.errors import AdvantageError

from .padding import pad_arrays, result_rollouts, to_padded
from .retry import RetryPolicy

if TYPE_CHECKING:
    from .grpc_client import GrpcClient
    from .http_client import HttpClient

__version__ = "0.1.0"

__all__ = [
    "AdvantageError",
    "GrpcClient",
    "HttpClient",
    "RetryPolicy",
    "__version__",
    "pad_arrays",
    "result_rollouts",
    "to_padded",
]

_CLIENTS = {"GrpcClient": ".grpc_client", "HttpClient": ".http_client"}


def __getattr__(name: str) -> Any:
    module = _CLIENTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
