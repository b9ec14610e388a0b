"""The flat request the clients would send for a padded call, without a service to send it to."""

from __future__ import annotations

from typing import Any

from advantage_contract.backend import RemoteBackend
from advantage_contract.padded import FlatRequest, PaddedResult


class _Unsent(RemoteBackend):
    """A client that keeps the request its ``compute_padded`` built instead of sending it."""

    client_name = "a test"

    def __init__(self) -> None:
        self.request: FlatRequest | None = None

    def _compute_flat(self, req: FlatRequest) -> PaddedResult:
        self.request = req
        return PaddedResult(advantages=None, scalars=None)

    def close(self) -> None:
        pass


def padded_request(
    tokens: Any, mask: Any, rewards: Any, group_ids: Any, **given: Any
) -> FlatRequest:
    """What the HTTP and gRPC clients' ``compute_padded(tokens, mask, rewards, group_ids,
    **given)`` checks and gathers into the flat layout (the contract's defaults for what
    ``given`` leaves out), refused by the name ``"a test"``."""
    with _Unsent() as client:
        client.compute_padded(tokens, mask, rewards, group_ids, **given)
    assert client.request is not None
    return client.request
