"""``GrpcClient``: ``advantage.v1.AdvantageService`` with numpy arrays in and out.

The messages are built and read in :mod:`advantage_client.grpc_codec`, and a stream's
rollouts kept for a reconnect in :mod:`advantage_client.grpc_stream`; the codec's names are
imported here too, where callers have always found them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc

from advantage_contract.backend import RemoteBackend, check_contract
from advantage_contract.grpc_gen import advantage_pb2 as pb
from advantage_contract.grpc_gen import advantage_pb2_grpc as pb_grpc
from advantage_contract.padded import FlatRequest, PaddedResult

from .grpc_codec import (
    STREAM_ROLLOUT_FIELDS,
    compute_request_message,
    compute_response_dict,
    error_dict,
    error_from_rpc,
    flat_request_message,
    flat_response_result,
    from_tensor,
    is_retryable,
    options_message,
    rollout_message,
    stream_result_dict,
    summary_dict,
    to_tensor,
)
from .grpc_stream import StreamState
from .retry import Retryable, RetryLog, RetryPolicy, RetryStats

__all__ = [
    "CHANNEL_OPTIONS",
    "STREAM_ROLLOUT_FIELDS",
    "GrpcClient",
    "compute_request_message",
    "compute_response_dict",
    "error_dict",
    "error_from_rpc",
    "flat_request_message",
    "flat_response_result",
    "from_tensor",
    "is_retryable",
    "options_message",
    "rollout_message",
    "stream_result_dict",
    "summary_dict",
    "tls_credentials",
    "to_tensor",
]

# Unlimited on the client: the server's ADV_MAX_BODY_BYTES is the limit that matters.
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
)


def tls_credentials(
    ca_file: str | None = None, client_cert: str | None = None, client_key: str | None = None
) -> grpc.ChannelCredentials:
    """Channel TLS credentials: the service's CA (gRPC's default roots when None) and a
    client certificate for mutual TLS."""

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as handle:
            return handle.read()

    return grpc.ssl_channel_credentials(
        root_certificates=read(ca_file),
        private_key=read(client_key),
        certificate_chain=read(client_cert),
    )


class GrpcClient(RemoteBackend):
    """A client of the gRPC API.

    ``target`` is ``host:port``. ``timeout`` (seconds) bounds each unary call;
    ``stream_timeout`` a whole stream (None: no bound). Unary calls are retried with
    exponential backoff on UNAVAILABLE (an overload refusal, or no server) and on saturation
    (RESOURCE_EXHAUSTED with code ``saturated``, from services before UNAVAILABLE); an overload
    refusal's wait is its ``retry-after-ms`` trailing metadata, else ``retry-after`` (see
    :class:`RetryPolicy`), never above ``max_backoff``. A stream that loses its server (or is
    refused) reconnects after the same wait and sends again the rollouts of groups not yet
    answered. Both give up after ``retries`` retries, or, by default (``retries=None``), once
    they have waited ``retry_for`` seconds (60) in all.

    ``token``: the bearer token (``authorization`` metadata on every call). TLS: ``ca_file``
    (the CA that signed the service's certificate) and, for mutual TLS, ``client_cert`` and
    ``client_key``; or ready-made ``credentials``.
    """

    client_name = "the gRPC client"

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = 60.0,
        stream_timeout: float | None = None,
        retries: int | None = None,
        backoff: float = 0.1,
        max_backoff: float = 10.0,
        retry_for: float = 60.0,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] = (),
        token: str | None = None,
        ca_file: str | None = None,
        client_cert: str | None = None,
        client_key: str | None = None,
    ) -> None:
        channel_options = [*CHANNEL_OPTIONS, *options]
        self.target = target
        if credentials is None and (ca_file or client_cert):
            credentials = tls_credentials(ca_file, client_cert, client_key)
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token is not None else ()
        )
        self.channel = (
            grpc.secure_channel(target, credentials, options=channel_options)
            if credentials is not None
            else grpc.insecure_channel(target, options=channel_options)
        )
        self.stub = pb_grpc.AdvantageServiceStub(self.channel)
        self.timeout = timeout
        self.stream_timeout = stream_timeout
        self.retry = RetryPolicy(retries, backoff, max_backoff, retry_for)
        # Retries over this client's life (each also logged): a trainer's metric.
        self.retry_stats = RetryStats()

    def close(self) -> None:
        self.channel.close()

    def _unary(self, method: Any, message: Any) -> Any:
        def attempt() -> Any:
            try:
                return method(message, timeout=self.timeout, metadata=self.metadata)
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
                if is_retryable(error):
                    raise Retryable(error, error.retry_after, error.retry_after_ms) from None
                raise error from None

        path = getattr(method, "_method", None)  # (b"/advantage.v1.AdvantageService/Compute")
        name = path.decode().rsplit("/", 1)[-1] if isinstance(path, bytes) else "call"
        what = f"gRPC {name} to {self.target}"
        return self.retry.run(attempt, what=what, stats=self.retry_stats)

    def compute(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """The HTTP JSON request in (lists or numpy arrays), the JSON response out with numpy
        float32 arrays for the per-token lists. Raises :class:`AdvantageError`."""
        response = self._unary(self.stub.Compute, compute_request_message(request))
        return compute_response_dict(response)

    def _compute_flat(self, req: FlatRequest) -> PaddedResult:
        """A padded call's flat arrays as one unary ``Compute`` of raw tensors."""
        response = self._unary(self.stub.Compute, flat_request_message(req))
        return flat_response_result(response, req)

    def list_estimators(self) -> dict[str, Any]:
        """The same object as HTTP's ``GET /v1/estimators``."""
        response = self._unary(self.stub.ListEstimators, pb.ListEstimatorsRequest())
        listing: dict[str, Any] = json.loads(response.listing_json)
        check_contract(listing, f"the service at {self.target}")
        return listing

    def stream(
        self,
        rollouts: Iterable[Mapping[str, Any]],
        *,
        estimator: Any = None,
        namespace: str | None = None,
        returns: Sequence[str] | None = None,
        ignore_token_ids: Sequence[int] | None = None,
        vocab_size: int | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Send rollouts as ``rollouts`` yields them (each with ``group_id``, ``group_size``,
        optional ``rollout_id``, ``tokens``, ``reward``, optional ``logprobs``, ``entropy``,
        ``sum_pi_squared``, ``is_weights`` and ``teacher_logprobs``); yield each group's result
        as soon as the service has computed it, in completion order: ``{"id", "rollouts":
        [{"rollout_id", "rollout_index", "advantages", ...}], "summary"}``, or ``{"id",
        "error": {...}, "rollout_ids"}`` for a group the service refused (the stream goes on).

        ``rollouts`` is read on a gRPC thread while results come back; closing the returned
        generator cancels the call. Raises :class:`AdvantageError` for a stream-level error,
        or for a rollout dict that cannot be sent (after cancelling the call).
        """
        options = options_message(
            namespace=namespace,
            estimator=estimator,
            ignore_token_ids=ignore_token_ids,
            vocab_size=vocab_size,
            returns=returns,
        )
        state = StreamState(iter(rollouts))
        failures, waited = 0, 0.0
        retry_log = RetryLog(self.retry, f"gRPC StreamCompute to {self.target}", self.retry_stats)
        while True:
            attempt, replay = state.begin()
            call = self.stub.StreamCompute(
                state.requests(attempt, options, replay),
                timeout=self.stream_timeout,
                metadata=self.metadata,
            )
            try:
                for response in call:
                    if state.error is not None:
                        raise state.error
                    failures, waited = 0, 0.0
                    state.answered(response)
                    yield stream_result_dict(response)
                if state.error is not None:
                    raise state.error
                return
            except grpc.RpcError as exc:
                if state.error is not None:
                    raise state.error from None
                error = error_from_rpc(exc)
                if not is_retryable(error) or self.retry.exhausted(failures, waited):
                    raise error from None
                wait = self.retry.delay(failures, error.retry_after, error.retry_after_ms)
                retry_log.retrying(error, failures, waited, wait)
                time.sleep(wait)
                waited += wait
                failures += 1
            finally:
                call.cancel()
