"""Clients of the advantage service: per-token advantages for groups of rollouts.

- :class:`HttpClient` (``POST /v1/advantages``, Arrow IPC on the wire by default) and
  :class:`GrpcClient` (``advantage.v1.AdvantageService``): ``.compute(request) -> response``,
  the service's JSON request and response as dicts, per-token arrays as numpy float32.
- :meth:`GrpcClient.stream`: rollouts in as they finish, each group's result out as soon as
  the group is complete.
- :func:`to_padded`: results as the (batch, max_len) right-padded arrays trainers use.

Light on purpose: numpy, httpx, grpcio, protobuf and pyarrow; no torch.
"""

from .errors import AdvantageError
from .grpc_client import GrpcClient
from .http_client import HttpClient
from .padding import pad_arrays, result_rollouts, to_padded
from .retry import RetryPolicy

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
