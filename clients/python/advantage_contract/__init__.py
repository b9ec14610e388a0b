"""The contract between advantage-service and its clients, read by both sides.

- :mod:`.fields`: the request's fields, the per-token inputs and their limits.
- :mod:`.errors`: the one error object of every wire (:class:`~.errors.AdvantageError`).
- :mod:`.flat` and :mod:`.padded`: the flat batch layout and the trainers' padded one.
- :mod:`.grpc_gen`: the generated gRPC modules of ``proto/advantage/v1/advantage.proto``.
- :mod:`.methods`: the methods and the inputs each reads (generated from the registry).
- :mod:`.backend`: the protocol every backend implements (``compute_padded``,
  ``list_estimators``), and how the in-process one is found.

It imports neither the service nor the clients (numpy only, and protobuf for ``grpc_gen``).
"""

# The version of this contract: the service lists it (``GET /v1/estimators``'s ``contract``)
# and a client of another version warns. Raise it when a field, a limit or a layout changes.
# (3: reward_components on every wire, and the summary's per-component statistics)
CONTRACT_VERSION = 3

__all__ = ["CONTRACT_VERSION"]
