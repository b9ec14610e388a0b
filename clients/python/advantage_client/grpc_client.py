"""``GrpcClient``: ``advantage.v1.AdvantageService`` with numpy arrays in and out."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from .errors import AdvantageError
from .flat import (
    TOKEN_FIELDS,
    check_top_level,
    flatten_groups,
    is_number,
    narrow_tokens,
    nest_rows,
    split_rows,
    token_array,
)
from .grpc_gen import advantage_pb2 as pb
from .grpc_gen import advantage_pb2_grpc as pb_grpc
from .padded import (
    FlatRequest,
    PaddedResult,
    flat_request,
    result_from_flat,
)
from .retry import Retryable, RetryPolicy

# numpy dtype -> wire dtype; arrays of other dtypes are converted to the nearest of these.
WIRE_DTYPES: dict[np.dtype[Any], pb.DType] = {
    np.dtype(np.int32): pb.DTYPE_INT32,
    np.dtype(np.int64): pb.DTYPE_INT64,
    np.dtype(np.float32): pb.DTYPE_FLOAT32,
    np.dtype(np.float64): pb.DTYPE_FLOAT64,
}
NUMPY_DTYPES = {wire: np.dtype(dt).newbyteorder("<") for dt, wire in WIRE_DTYPES.items()}
STREAM_ROLLOUT_FIELDS = (
    "group_id",
    "group_size",
    "rollout_id",
    "tokens",
    "reward",
    *TOKEN_FIELDS,
    "teacher_logprobs",
    "prompt_key",
)
# Unlimited on the client: the server's ADV_MAX_BODY_BYTES is the limit that matters.
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
)


def to_tensor(values: np.ndarray) -> pb.Tensor:
    """A 1-D array as raw little-endian bytes with its dtype."""
    array = np.asarray(values)
    dtype = array.dtype.newbyteorder("=")
    if dtype not in WIRE_DTYPES:
        dtype = np.dtype(np.int64 if array.dtype.kind in "iub" else np.float64)
    wire = WIRE_DTYPES[dtype]
    data = np.ascontiguousarray(array, dtype=NUMPY_DTYPES[wire]).tobytes()
    return pb.Tensor(dtype=wire, data=data)


def from_tensor(tensor: pb.Tensor) -> np.ndarray:
    """A wire tensor as a native numpy array (a view of the message's bytes, read-only)."""
    array = np.frombuffer(tensor.data, dtype=NUMPY_DTYPES[tensor.dtype])
    return array.astype(array.dtype.newbyteorder("="), copy=False)


def options_message(
    *,
    namespace: str | None = None,
    estimator: Any = None,
    ignore_token_ids: Sequence[int] | None = None,
    vocab_size: int | None = None,
    returns: Sequence[str] | None = None,
) -> pb.ComputeOptions:
    """The JSON request's options: ``estimator`` a preset name or an estimator object."""
    options = pb.ComputeOptions(namespace=namespace or "")
    if isinstance(estimator, str):
        options.preset = estimator
    elif estimator is not None:
        options.estimator_json = json.dumps(estimator)
    if ignore_token_ids:
        options.ignore_token_ids.extend(int(t) for t in ignore_token_ids)
    if vocab_size is not None:
        options.vocab_size = int(vocab_size)
    if returns:
        options.returns.extend(returns)
    return options


def compute_request_message(request: Mapping[str, Any]) -> pb.ComputeRequest:
    """The HTTP JSON request (lists or numpy arrays inside) as a ``ComputeRequest``."""
    check_top_level(request)
    flat = flatten_groups(request.get("groups")).for_wire()
    message = pb.ComputeRequest(
        request_id=request.get("request_id") or "",
        options=options_message(
            namespace=request.get("namespace"),
            estimator=request.get("estimator"),
            ignore_token_ids=request.get("ignore_token_ids"),
            vocab_size=request.get("vocab_size"),
            returns=request.get("return"),
        ),
        group_ids=flat.group_ids,
        group_index=to_tensor(flat.group_index),
        offsets=to_tensor(flat.offsets),
        tokens=to_tensor(flat.tokens),
        rewards=to_tensor(flat.rewards),
    )
    if flat.prompt_keys is not None:
        message.prompt_keys.extend(key or "" for key in flat.prompt_keys)
    for name, values in flat.token_values().items():
        getattr(message, name).CopyFrom(to_tensor(values))
    for name, values in flat.teacher_logprobs.items():
        message.teacher_logprobs[name].CopyFrom(to_tensor(values))
    return message


def flat_request_message(req: FlatRequest) -> pb.ComputeRequest:
    """A padded call's flat arrays as a ``ComputeRequest`` (raw tensors, trainer's row order)."""
    layout, options = req.layout, req.options
    message = pb.ComputeRequest(
        request_id=options.get("request_id") or "",
        options=options_message(
            namespace=options.get("namespace"),
            estimator=options.get("estimator"),
            ignore_token_ids=options.get("ignore_token_ids"),
            returns=options.get("return"),
        ),
        group_ids=layout.group_ids,
        group_index=to_tensor(layout.group_index),
        offsets=to_tensor(layout.offsets),
        tokens=to_tensor(req.tokens),
        rewards=to_tensor(layout.rewards),
    )
    if req.prompt_keys is not None:
        message.prompt_keys.extend(key or "" for key in req.prompt_keys)
    for name, values in req.per_token.items():
        getattr(message, name).CopyFrom(to_tensor(values))
    for name, values in req.teacher_logprobs.items():
        message.teacher_logprobs[name].CopyFrom(to_tensor(values))
    return message


def flat_response_result(response: pb.ComputeResponse, req: FlatRequest) -> PaddedResult:
    """A ``ComputeResponse`` (flat, request order) scattered back into the padded layout."""
    return result_from_flat(
        req.layout,
        from_tensor(response.advantages),
        from_tensor(response.scalars),
        {name: from_tensor(values) for name, values in response.diagnostics.items()},
        req.token_ids,
        summary_dict(response.summary),
    )


def summary_dict(summary: pb.Summary) -> dict[str, Any]:
    out = {
        "tokens": summary.tokens,
        "rollouts": summary.rollouts,
        "groups": summary.groups,
        "zero_signal_groups": summary.zero_signal_groups,
        "device": summary.device,
        "compute_ms": summary.compute_ms,
        "history": summary.history,
        # (0 from a server of an earlier release, which never merged: one request each)
        "batch_requests": summary.batch_requests or 1,
        # (unset: nothing recorded, or a server of an earlier release)
        "recorded": summary.recorded if summary.HasField("recorded") else None,
    }
    if summary.group_history:
        # (per group, what its history read gave; the JSON answer has it on each group)
        out["group_history"] = list(summary.group_history)
    return out


def compute_response_dict(response: pb.ComputeResponse) -> dict[str, Any]:
    """The response as the HTTP JSON response, with numpy float32 arrays for lists."""
    offsets = from_tensor(response.offsets)
    columns: dict[str, Sequence[Any]] = {
        "advantages": split_rows(from_tensor(response.advantages), offsets)
    }
    if response.HasField("scalars"):
        columns["scalar"] = from_tensor(response.scalars).tolist()
    for name, values in response.diagnostics.items():
        columns[name] = split_rows(from_tensor(values), offsets)
    rows = [
        dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)
    ]
    groups = nest_rows(list(response.group_ids), from_tensor(response.group_index), rows)
    summary = summary_dict(response.summary)
    per_group = summary.pop("group_history", None)
    if per_group is not None:
        for group, history in zip(groups, per_group, strict=True):
            group["history"] = history
    return {
        "request_id": response.request_id,
        "namespace": response.namespace,
        "estimator": json.loads(response.estimator_json),
        "groups": groups,
        "summary": summary,
    }


def rollout_message(rollout: Mapping[str, Any]) -> pb.Rollout:
    """A stream rollout dict (``group_id``, ``group_size``, optional ``rollout_id``,
    ``tokens``, ``reward``, optional ``logprobs``, ``entropy``, ``sum_pi_squared``,
    ``is_weights``, ``teacher_logprobs`` and ``prompt_key``) as a ``Rollout``."""
    if not isinstance(rollout, Mapping):
        raise AdvantageError("invalid_type", "a rollout must be a dict", field="rollouts")
    gid = rollout.get("group_id")
    where: dict[str, Any] = {"group_id": gid if isinstance(gid, str) else None}
    extra = set(rollout) - set(STREAM_ROLLOUT_FIELDS)
    if extra:
        raise AdvantageError(
            "unknown_field",
            f"rollout has unknown fields {sorted(extra)}; known: {list(STREAM_ROLLOUT_FIELDS)}",
            field=sorted(extra)[0],
            **where,
        )
    if not isinstance(gid, str):
        raise AdvantageError(
            "invalid_type", f"group_id must be a string, got {gid!r}", field="group_id"
        )
    size = rollout.get("group_size")
    if not isinstance(size, int | np.integer) or isinstance(size, bool) or size < 1:
        raise AdvantageError(
            "invalid_type",
            f"group_size must be a positive integer, got {size!r}",
            field="group_size",
            **where,
        )
    if "tokens" not in rollout:
        raise AdvantageError("missing_input", "tokens is required", field="tokens", **where)
    reward = rollout.get("reward")
    if not is_number(reward):
        raise AdvantageError(
            "invalid_type", f"reward must be a number, got {reward!r}", field="reward", **where
        )
    rid = rollout.get("rollout_id")
    key = rollout.get("prompt_key")
    if key is not None and not isinstance(key, str):
        raise AdvantageError(
            "invalid_type",
            f"prompt_key must be a string, got {key!r:.80}",
            field="prompt_key",
            **where,
        )
    message = pb.Rollout(
        group_id=gid,
        group_size=int(size),
        rollout_id="" if rid is None else str(rid),
        tokens=to_tensor(narrow_tokens(token_array(rollout["tokens"], field="tokens", **where))),
        reward=float(reward),
        prompt_key=key or "",
    )
    for name in TOKEN_FIELDS:
        if rollout.get(name) is not None:
            values = np.asarray(rollout[name], dtype=np.float32)
            getattr(message, name).CopyFrom(to_tensor(values))
    teacher = rollout.get("teacher_logprobs") or {}
    if not isinstance(teacher, Mapping):
        raise AdvantageError(
            "invalid_type",
            "teacher_logprobs must map condition names to lists",
            field="teacher_logprobs",
            **where,
        )
    for name, values in teacher.items():
        message.teacher_logprobs[str(name)].CopyFrom(
            to_tensor(np.asarray(values, dtype=np.float32))
        )
    return message


def error_dict(error: pb.Error) -> dict[str, Any]:
    return {
        "code": error.code,
        "message": error.message,
        "group_id": error.group_id or None,
        "rollout_index": error.rollout_index if error.HasField("rollout_index") else None,
        "field": error.field or None,
    }


def stream_result_dict(response: pb.StreamResponse) -> dict[str, Any]:
    """A group result ``{"id", "rollouts": [{"rollout_id", "rollout_index", "advantages",
    ...}], "summary"}`` or a group error ``{"id", "error": {...}, "rollout_ids": [...]}``."""
    if response.WhichOneof("kind") == "error":
        err = response.error
        return {
            "id": err.group_id,
            "error": error_dict(err.error),
            "rollout_ids": list(err.rollout_ids),
        }
    result = response.result
    rollouts = []
    for r in result.rollouts:
        item: dict[str, Any] = {
            "rollout_id": r.rollout_id or None,
            "rollout_index": r.rollout_index,
            "advantages": from_tensor(r.advantages),
        }
        if r.HasField("scalar"):
            item["scalar"] = r.scalar
        for name, values in r.diagnostics.items():
            item[name] = from_tensor(values)
        rollouts.append(item)
    return {
        "id": result.group_id,
        "rollouts": rollouts,
        "request_id": result.request_id,
        "summary": summary_dict(result.summary),
    }


def _metadata(exc: grpc.Call) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in exc.trailing_metadata() or ():
        key, value = item
        out[key] = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return out


def _whole(value: Any) -> int | None:
    """A metadata value that is a whole non-negative number, else None."""
    text = str(value).strip() if value is not None else ""
    return int(text) if text.isdigit() else None


def error_from_rpc(exc: grpc.RpcError) -> AdvantageError:
    """The service's error (status details + trailing metadata) as an AdvantageError, with its
    retry hints: ``retry-after`` (seconds) and ``retry-after-ms``."""
    call: Any = exc
    code = call.code()
    meta = _metadata(call) if hasattr(call, "trailing_metadata") else {}
    index = meta.get("advantage-rollout-index")
    retry_after = _whole(meta.get("retry-after"))
    return AdvantageError(
        meta.get("advantage-error-code") or code.name.lower(),
        call.details() or code.name,
        group_id=meta.get("advantage-group-id-bin"),
        rollout_index=int(index) if index is not None else None,
        field=meta.get("advantage-field-bin"),
        grpc_code=code.name,
        retry_after=float(retry_after) if retry_after is not None else None,
        retry_after_ms=_whole(meta.get("retry-after-ms")),
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


def is_retryable(error: AdvantageError) -> bool:
    """UNAVAILABLE (overloaded, no server yet, a restart), and overload under any status:
    ``overloaded``, or ``saturated`` (RESOURCE_EXHAUSTED, HTTP's 429, from services before
    UNAVAILABLE)."""
    return error.grpc_code == "UNAVAILABLE" or error.code in ("overloaded", "saturated")


class _StreamState:
    """What a stream has sent and not had answered, so that a reconnect can send it again.

    The trainer's iterator is read on gRPC's request thread and may block for as long as a
    rollout takes to generate, so it is read outside ``lock`` (which the response side takes).
    """

    def __init__(self, source: Iterator[Mapping[str, Any]]) -> None:
        self.source = source
        self.pull_lock = threading.Lock()
        self.lock = threading.Lock()
        self.attempt = 0
        # group id -> its rollouts sent and not answered, in sending order
        self.unanswered: dict[str, list[pb.Rollout]] = {}
        # group id -> rollouts of a group answered with an error still to come (never sent:
        # the service would drop them)
        self.failed: dict[str, int] = {}
        # rollouts read for an attempt that ended meanwhile: the next attempt sends them
        self.carry: list[pb.Rollout] = []
        self.error: BaseException | None = None

    def begin(self) -> tuple[int, list[pb.Rollout]]:
        """Start an attempt: its number and the rollouts to send again first."""
        with self.lock:
            self.attempt += 1
            self.carry.clear()
            replay = [m for messages in self.unanswered.values() for m in messages]
            return self.attempt, replay

    def next_message(self, attempt: int) -> pb.Rollout | None:
        """The next rollout to send on attempt ``attempt`` (None: stop sending)."""
        with self.pull_lock:
            while True:
                with self.lock:
                    if attempt != self.attempt or self.error is not None:
                        return None
                    if self.carry:
                        return self.carry.pop(0)
                try:
                    message = rollout_message(next(self.source))
                except StopIteration:
                    return None
                except Exception as exc:  # a bad rollout dict, or the trainer's iterator failed
                    with self.lock:
                        self.error = exc
                    return None
                with self.lock:
                    gid = message.group_id
                    remaining = self.failed.get(gid)
                    if remaining is not None:
                        if remaining <= 1:
                            del self.failed[gid]
                        else:
                            self.failed[gid] = remaining - 1
                        continue
                    self.unanswered.setdefault(gid, []).append(message)
                    if attempt != self.attempt:
                        self.carry.append(message)
                        return None
                    return message

    def answered(self, response: pb.StreamResponse) -> None:
        with self.lock:
            if response.WhichOneof("kind") == "result":
                self.unanswered.pop(response.result.group_id, None)
                return
            gid = response.error.group_id
            sent = self.unanswered.pop(gid, [])
            if sent and sent[0].group_size > len(sent):
                self.failed[gid] = sent[0].group_size - len(sent)


class GrpcClient:
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

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GrpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unary(self, method: Any, message: Any) -> Any:
        def attempt() -> Any:
            try:
                return method(message, timeout=self.timeout, metadata=self.metadata)
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
                if is_retryable(error):
                    raise Retryable(error, error.retry_after, error.retry_after_ms) from None
                raise error from None

        return self.retry.run(attempt)

    def compute(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """The HTTP JSON request in (lists or numpy arrays), the JSON response out with numpy
        float32 arrays for the per-token lists. Raises :class:`AdvantageError`."""
        response = self._unary(self.stub.Compute, compute_request_message(request))
        return compute_response_dict(response)

    def compute_padded(
        self,
        tokens: Any,
        mask: Any,
        rewards: Any,
        group_ids: Any,
        *,
        estimator: Any = "grpo",
        logprobs: Any = None,
        teacher_logprobs: Mapping[str, Any] | None = None,
        entropy: Any = None,
        sum_pi_squared: Any = None,
        is_weights: Any = None,
        planning_mask: Any = None,
        diagnostics: Sequence[str] = (),
        ignore_token_ids: Sequence[int] | None = None,
        namespace: str | None = None,
        request_id: str | None = None,
        prompt_keys: Any = None,
    ) -> PaddedResult:
        """Advantages for a trainer's padded batch, sent as one unary ``Compute`` of raw
        tensors; the same arguments and result as :meth:`HttpClient.compute_padded`.
        Raises :class:`AdvantageError`."""
        req = flat_request(
            tokens,
            mask,
            rewards,
            group_ids,
            estimator=estimator,
            logprobs=logprobs,
            entropy=entropy,
            sum_pi_squared=sum_pi_squared,
            is_weights=is_weights,
            planning_mask=planning_mask,
            teacher_logprobs=teacher_logprobs,
            diagnostics=diagnostics,
            ignore_token_ids=ignore_token_ids,
            namespace=namespace,
            request_id=request_id,
            client="the gRPC client",
            prompt_keys=prompt_keys,
        )
        response = self._unary(self.stub.Compute, flat_request_message(req))
        return flat_response_result(response, req)

    def list_estimators(self) -> dict[str, Any]:
        """The same object as HTTP's ``GET /v1/estimators``."""
        response = self._unary(self.stub.ListEstimators, pb.ListEstimatorsRequest())
        listing: dict[str, Any] = json.loads(response.listing_json)
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
        state = _StreamState(iter(rollouts))
        failures, waited = 0, 0.0
        while True:
            attempt, replay = state.begin()
            call = self.stub.StreamCompute(
                self._stream_requests(state, attempt, options, replay),
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
                time.sleep(wait)
                waited += wait
                failures += 1
            finally:
                call.cancel()

    def _stream_requests(
        self,
        state: _StreamState,
        attempt: int,
        options: pb.ComputeOptions,
        replay: list[pb.Rollout],
    ) -> Iterator[pb.StreamRequest]:
        yield pb.StreamRequest(options=options)
        for message in replay:
            yield pb.StreamRequest(rollout=message)
        while (fresh := state.next_message(attempt)) is not None:
            yield pb.StreamRequest(rollout=fresh)
