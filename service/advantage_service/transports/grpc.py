"""The gRPC transport (grpc.aio): ``advantage.v1.AdvantageService`` over the one engine.

Wire messages in, :class:`ComputeRequest` to the engine, results back out; no math, no policy.
Flat arrays travel as raw little-endian bytes with an explicit dtype and become the flat batch
through ``np.frombuffer`` and :meth:`RolloutBatch.from_flat`, as the Arrow codec's buffers do.

``StreamCompute`` assembles groups from rollouts that arrive one by one and computes each group
as soon as its last rollout is in, as one engine request (so its numbers are those of the group
computed alone). Per stream it bounds the incomplete groups and the tokens they hold, and the
responses outstanding (computing or not yet written): when that many are out it stops reading,
so gRPC flow control holds the client back instead of the server buffering without end.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from .. import jsonio
from ..auth import AuthError, Principal
from ..batch import RolloutBatch
from ..config import Settings
from ..engine import UNKNOWN_ESTIMATOR, Engine, Saturated, Slot
from ..errors import LimitExceeded, RequestError
from ..estimators import AdvantageResult
from ..request import ComputeRequest, parse_request
from .grpc_gen import advantage_pb2 as pb
from .grpc_gen import advantage_pb2_grpc as pb_grpc
from .http import EstimatorListing, estimator_listing

log = logging.getLogger("advantage_service.grpc")

TRANSPORT = "grpc"
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["AdvantageService"].full_name

# Wire dtype -> numpy dtype of the raw bytes (little-endian whatever the host).
WIRE_DTYPES: dict[int, np.dtype[Any]] = {
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_FLOAT64: np.dtype("<f8"),
}
# Trailing metadata keys of an error (values of -bin keys are UTF-8 bytes).
ERROR_CODE_KEY = "advantage-error-code"
GROUP_ID_KEY = "advantage-group-id-bin"
ROLLOUT_INDEX_KEY = "advantage-rollout-index"
FIELD_KEY = "advantage-field-bin"
RETRY_AFTER_KEY = "retry-after"
INTERNAL_MESSAGE = "internal error; see the service log"
SHUTTING_DOWN = RequestError(
    "shutting_down", "the service is shutting down; retry on another replica", status=503
)

# Stream limits when the settings do not carry them.
DEFAULT_STREAM_MAX_PENDING_GROUPS = 4096
# Longest wait between two tries for an admission slot for a completed stream group.
ADMISSION_POLL_MAX_SECONDS = 0.02


# ---- arrays ------------------------------------------------------------------------------------


def read_tensor(tensor: pb.Tensor, name: str, *, integer: bool, **where: Any) -> np.ndarray:
    """The values of a wire tensor as a writable native array (int64 or float64 for integer
    dtypes read as floats; the batch casts to its own dtypes)."""
    dtype = WIRE_DTYPES.get(tensor.dtype)
    if dtype is None:
        given = pb.DType.Name(tensor.dtype) if tensor.dtype in pb.DType.values() else tensor.dtype
        raise RequestError(
            "invalid_type",
            f"{name}.dtype must be one of {[pb.DType.Name(d) for d in WIRE_DTYPES]}, got {given}",
            field=name,
            **where,
        )
    if integer and dtype.kind != "i":
        raise RequestError(
            "invalid_type",
            f"{name} must hold integers, got {pb.DType.Name(tensor.dtype)}",
            field=name,
            **where,
        )
    data = tensor.data  # each access of a bytes field makes a new bytes object: read it once
    if len(data) % dtype.itemsize:
        raise RequestError(
            "invalid_shape",
            f"{name} has {len(data)} bytes, not a whole number of "
            f"{dtype.itemsize}-byte {pb.DType.Name(tensor.dtype)} values",
            field=name,
            **where,
        )
    raw = np.frombuffer(data, dtype=dtype)
    # One copy into native order; it also makes the array writable, which torch wants.
    return raw.astype(np.int64 if integer else dtype.newbyteorder("="), copy=True)


def write_tensor(values: np.ndarray) -> pb.Tensor:
    """A float32 or int64 array as a wire tensor."""
    kind = pb.DTYPE_FLOAT32 if values.dtype.kind == "f" else pb.DTYPE_INT64
    wire = WIRE_DTYPES[kind]
    return pb.Tensor(dtype=kind, data=np.ascontiguousarray(values, dtype=wire).tobytes())


# ---- requests and responses -------------------------------------------------------------------


def options_object(options: pb.ComputeOptions, request_id: str = "") -> dict[str, Any]:
    """The wire options as the HTTP JSON request's top-level fields (without ``groups``)."""
    obj: dict[str, Any] = {}
    if request_id:
        obj["request_id"] = request_id
    if options.namespace:
        obj["namespace"] = options.namespace
    which = options.WhichOneof("estimator")
    if which == "preset":
        obj["estimator"] = options.preset
    elif which == "estimator_json":
        try:
            obj["estimator"] = jsonio.loads(options.estimator_json)
        except RequestError as exc:
            raise RequestError(
                "invalid_json",
                f"estimator_json is not valid JSON: {exc.message}",
                field="estimator_json",
            ) from exc
    if options.ignore_token_ids:
        obj["ignore_token_ids"] = list(options.ignore_token_ids)
    if options.HasField("vocab_size"):
        obj["vocab_size"] = int(options.vocab_size)
    if options.returns:
        obj["return"] = list(options.returns)
    return obj


def _required(message: Any, name: str) -> pb.Tensor:
    if not message.HasField(name):
        raise RequestError("missing_input", f"{name} is required", field=name)
    tensor: pb.Tensor = getattr(message, name)
    return tensor


def decode_compute_request(request: pb.ComputeRequest) -> ComputeRequest:
    """A unary request as a validated :class:`ComputeRequest` (the JSON contract's checks)."""

    def batch_from_arrays(groups: Any, vocab_size: int | None) -> RolloutBatch:
        return RolloutBatch.from_flat(
            tokens=read_tensor(_required(request, "tokens"), "tokens", integer=True),
            offsets=read_tensor(_required(request, "offsets"), "offsets", integer=True),
            group_ids=list(request.group_ids),
            group_index=read_tensor(_required(request, "group_index"), "group_index", integer=True),
            rewards=read_tensor(_required(request, "rewards"), "rewards", integer=False),
            logprobs=(
                read_tensor(request.logprobs, "logprobs", integer=False)
                if request.HasField("logprobs")
                else None
            ),
            teacher_logprobs={
                name: read_tensor(values, f"teacher_logprobs.{name}", integer=False)
                for name, values in sorted(request.teacher_logprobs.items())
            },
            vocab_size=vocab_size,
        )

    return parse_request(
        options_object(request.options, request.request_id), decode_groups=batch_from_arrays
    )


def summary_message(summary: Mapping[str, Any]) -> pb.Summary:
    """The summary's fields the message has (a newer summary key is not an error here)."""
    fields = pb.Summary.DESCRIPTOR.fields_by_name
    return pb.Summary(**{k: v for k, v in summary.items() if k in fields and v is not None})


def encode_compute_response(
    req: ComputeRequest, result: AdvantageResult, summary: dict[str, Any]
) -> pb.ComputeResponse:
    """The unary response: flat arrays in the request's rollout order."""
    batch = req.batch
    response = pb.ComputeResponse(
        request_id=req.request_id,
        namespace=req.namespace,
        estimator_json=jsonio.dumps(req.estimator.to_dict()),
        group_ids=batch.group_ids,
        group_index=write_tensor(batch.group_index.cpu().numpy()),
        offsets=write_tensor(batch.offsets.cpu().numpy()),
        advantages=write_tensor(result.advantages.cpu().numpy()),
        summary=summary_message(summary),
    )
    for name in req.returns:
        if name == "scalar":
            response.scalars.CopyFrom(write_tensor(result.scalars.cpu().numpy()))
        else:
            response.diagnostics[name].CopyFrom(
                write_tensor(result.diagnostics[name].cpu().numpy())
            )
    return response


def estimators_message() -> pb.ListEstimatorsResponse:
    # Through the HTTP response model, so the JSON is byte for byte what GET /v1/estimators
    # answers (the model spells out the optional fields as null).
    listing = EstimatorListing.model_validate(estimator_listing()).model_dump(mode="json")
    return pb.ListEstimatorsResponse(
        default_preset=listing["default"],
        presets=sorted(listing["presets"]),
        outcomes=[o["name"] for o in listing["outcomes"]],
        terms=[t["name"] for t in listing["terms"]],
        diagnostics=listing["diagnostics"],
        listing_json=jsonio.dumps(listing),
    )


# ---- errors ------------------------------------------------------------------------------------


# HTTP status of an error -> its gRPC status (422 and everything else: INVALID_ARGUMENT).
STATUS_CODES = {
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def status_code(exc: RequestError | Saturated) -> grpc.StatusCode:
    """422 -> INVALID_ARGUMENT; 413 and saturation -> RESOURCE_EXHAUSTED; 401 ->
    UNAUTHENTICATED; 403 -> PERMISSION_DENIED; 504 -> DEADLINE_EXCEEDED."""
    if isinstance(exc, Saturated):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return STATUS_CODES.get(exc.status, grpc.StatusCode.INVALID_ARGUMENT)


def error_metadata(exc: RequestError | Saturated) -> tuple[tuple[str, str | bytes], ...]:
    """Trailing metadata locating the error (keys in the .proto's header comment)."""
    detail = exc.to_dict()
    metadata: list[tuple[str, str | bytes]] = [(ERROR_CODE_KEY, detail["code"])]
    if detail["group_id"] is not None:
        metadata.append((GROUP_ID_KEY, str(detail["group_id"]).encode()))
    if detail["rollout_index"] is not None:
        metadata.append((ROLLOUT_INDEX_KEY, str(detail["rollout_index"])))
    if detail["field"] is not None:
        metadata.append((FIELD_KEY, str(detail["field"]).encode()))
    if isinstance(exc, Saturated):
        metadata.append((RETRY_AFTER_KEY, str(exc.retry_after)))
    return tuple(metadata)


def error_message(exc: RequestError) -> pb.Error:
    error = pb.Error(
        code=exc.code, message=exc.message, group_id=exc.group_id or "", field=exc.field or ""
    )
    if exc.rollout_index is not None:
        error.rollout_index = exc.rollout_index
    return error


async def abort(context: grpc.aio.ServicerContext, exc: RequestError | Saturated) -> None:
    """End the call with the error's status, message and trailing metadata (raises)."""
    await context.abort(status_code(exc), exc.message, trailing_metadata=error_metadata(exc))


# ---- messages that do not parse ----------------------------------------------------------------


@dataclass(frozen=True)
class Malformed:
    """A request message whose bytes are not the message (what the lenient deserializers give
    instead of raising: gRPC would answer UNKNOWN, or INTERNAL inside a stream)."""

    message: str

    def error(self) -> RequestError:
        return RequestError(
            "invalid_protobuf",
            f"the request message does not parse: {self.message}",
            field="message",
        )


def lenient(parse: Any) -> Any:
    """``parse`` (a message's FromString) that returns :class:`Malformed` on corrupt bytes."""

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return Malformed(str(exc))

    return deserialize


def add_servicer(servicer: AdvantageServicer, server: grpc.aio.Server) -> None:
    """Register the servicer as the generated ``add_AdvantageServiceServicer_to_server`` does,
    with deserializers that let a corrupt message be answered INVALID_ARGUMENT."""
    handlers = {
        "Compute": grpc.unary_unary_rpc_method_handler(
            servicer.Compute,
            request_deserializer=lenient(pb.ComputeRequest.FromString),
            response_serializer=pb.ComputeResponse.SerializeToString,
        ),
        "StreamCompute": grpc.stream_stream_rpc_method_handler(
            servicer.StreamCompute,
            request_deserializer=lenient(pb.StreamRequest.FromString),
            response_serializer=pb.StreamResponse.SerializeToString,
        ),
        "ListEstimators": grpc.unary_unary_rpc_method_handler(
            servicer.ListEstimators,
            request_deserializer=lenient(pb.ListEstimatorsRequest.FromString),
            response_serializer=pb.ListEstimatorsResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


# ---- stream assembly ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamLimits:
    """Per-stream bounds: incomplete groups, the tokens they hold, and responses outstanding
    (computing or not yet written) before the stream stops reading."""

    max_pending_groups: int = DEFAULT_STREAM_MAX_PENDING_GROUPS
    max_pending_tokens: int = 8_388_608
    max_outstanding: int = 8

    @classmethod
    def from_settings(cls, settings: Settings) -> StreamLimits:
        # ADV_STREAM_MAX_PENDING_GROUPS / _TOKENS when the settings define them; by default a
        # stream holds at most as many tokens as one request may carry.
        return cls(
            max_pending_groups=int(
                getattr(settings, "stream_max_pending_groups", DEFAULT_STREAM_MAX_PENDING_GROUPS)
            ),
            max_pending_tokens=int(
                getattr(settings, "stream_max_pending_tokens", settings.max_request_tokens)
            ),
            max_outstanding=2 * settings.max_inflight,
        )


@dataclass
class _Rollout:
    rollout_id: str
    tokens: np.ndarray
    reward: float
    logprobs: np.ndarray | None
    teacher_logprobs: dict[str, np.ndarray]


@dataclass
class _Group:
    group_id: str
    size: int
    rollouts: list[_Rollout] = field(default_factory=list)
    tokens: int = 0
    completed_at: float = 0.0

    @property
    def rollout_ids(self) -> list[str]:
        return [r.rollout_id for r in self.rollouts]

    def batch(self, vocab_size: int | None) -> RolloutBatch:
        """The group as a one-group flat batch, rollouts in arrival order."""
        rollouts = self.rollouts
        lengths = np.fromiter((r.tokens.size for r in rollouts), np.int64, len(rollouts))

        def per_token(get: Any, name: str) -> np.ndarray:
            values = []
            for i, r in enumerate(rollouts):
                v = get(r)
                if v is None:
                    raise RequestError(
                        "missing_input",
                        f"{name} is given for some rollouts but not this one; give it for "
                        "every rollout or none",
                        group_id=self.group_id,
                        rollout_index=i,
                        field=name,
                    )
                values.append(v)
            return np.concatenate(values)

        logprobs = (
            per_token(lambda r: r.logprobs, "logprobs")
            if any(r.logprobs is not None for r in rollouts)
            else None
        )
        conditions = sorted({c for r in rollouts for c in r.teacher_logprobs})
        return RolloutBatch.from_flat(
            tokens=np.concatenate([r.tokens for r in rollouts]),
            offsets=np.concatenate([[0], np.cumsum(lengths)]),
            group_ids=[self.group_id],
            group_index=np.zeros(len(rollouts), dtype=np.int64),
            rewards=np.array([r.reward for r in rollouts], dtype=np.float64),
            logprobs=logprobs,
            teacher_logprobs={
                c: per_token(lambda r, c=c: r.teacher_logprobs.get(c), f"teacher_logprobs.{c}")
                for c in conditions
            },
            vocab_size=vocab_size,
        )


def decode_rollout(rollout: pb.Rollout, rollout_index: int) -> _Rollout:
    """A stream rollout's arrays, checked against its own token count."""
    where: dict[str, Any] = {"group_id": rollout.group_id, "rollout_index": rollout_index}
    if not rollout.HasField("tokens"):
        raise RequestError("missing_input", "tokens is required", field="tokens", **where)
    if not rollout.HasField("reward"):
        raise RequestError("missing_input", "reward is required", field="reward", **where)
    tokens = read_tensor(rollout.tokens, "tokens", integer=True, **where)

    def per_token(tensor: pb.Tensor, name: str) -> np.ndarray:
        values = read_tensor(tensor, name, integer=False, **where)
        if values.size != tokens.size:
            raise RequestError(
                "length_mismatch",
                f"{name} has {values.size} values for {tokens.size} tokens",
                field=name,
                **where,
            )
        return values

    return _Rollout(
        rollout_id=rollout.rollout_id,
        tokens=tokens,
        reward=rollout.reward,
        logprobs=(
            per_token(rollout.logprobs, "logprobs") if rollout.HasField("logprobs") else None
        ),
        teacher_logprobs={
            name: per_token(values, f"teacher_logprobs.{name}")
            for name, values in rollout.teacher_logprobs.items()
        },
    )


def encode_group_result(
    group: _Group, req: ComputeRequest, result: AdvantageResult, summary: dict[str, Any]
) -> pb.StreamResponse:
    """A computed group: one RolloutResult per rollout, in arrival order."""
    offsets = req.batch.offsets.cpu().numpy()
    advantages = result.advantages.cpu().numpy()
    scalars = result.scalars.cpu().numpy() if "scalar" in req.returns else None
    diagnostics = {
        name: result.diagnostics[name].cpu().numpy() for name in req.returns if name != "scalar"
    }
    out = pb.GroupResult(
        group_id=group.group_id,
        request_id=req.request_id,
        estimator_json=jsonio.dumps(req.estimator.to_dict()),
        summary=summary_message(summary),
    )
    for i, rollout in enumerate(group.rollouts):
        start, end = int(offsets[i]), int(offsets[i + 1])
        item = out.rollouts.add(
            rollout_id=rollout.rollout_id,
            rollout_index=i,
            advantages=write_tensor(advantages[start:end]),
        )
        if scalars is not None:
            item.scalar = float(scalars[i])
        for name, values in diagnostics.items():
            item.diagnostics[name].CopyFrom(write_tensor(values[start:end]))
    return pb.StreamResponse(result=out)


def group_error(group_id: str, exc: RequestError, rollout_ids: Sequence[str]) -> pb.StreamResponse:
    return pb.StreamResponse(
        error=pb.GroupError(
            group_id=group_id, error=error_message(exc), rollout_ids=list(rollout_ids)
        )
    )


class _End:
    """The writer's stop mark; ``error`` set: end the call with it instead of OK."""

    def __init__(self, error: RequestError | None = None, internal: bool = False) -> None:
        self.error = error
        self.internal = internal


class _StreamSession:
    """One StreamCompute call: reads rollouts, assembles groups, computes them on the engine,
    queues the answers for the handler to write."""

    def __init__(self, servicer: AdvantageServicer, principal: Principal) -> None:
        self.principal = principal
        self.engine = servicer.engine
        self.settings = servicer.settings
        self.limits = servicer.limits
        self.metrics = servicer.engine.metrics
        self.template: ComputeRequest | None = None
        self.pending: dict[str, _Group] = {}
        self.pending_tokens = 0
        # Groups answered with an error -> rollouts of theirs still expected (dropped).
        self.failed: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.out: asyncio.Queue[pb.StreamResponse | _End] = asyncio.Queue()
        self.outstanding = asyncio.Semaphore(self.limits.max_outstanding)
        self.tasks: set[asyncio.Task[None]] = set()

    # ---- reading ----------------------------------------------------------------------------

    async def read(self, requests: AsyncIterator[pb.StreamRequest]) -> None:
        """Consume the client's messages until it half-closes, then flush and mark the end."""
        try:
            first = True
            async for message in requests:
                if isinstance(message, Malformed):
                    raise message.error()
                kind = message.WhichOneof("kind")
                if kind == "options":
                    if not first:
                        raise RequestError(
                            "invalid_stream",
                            "options may only be the first message of the stream",
                            field="options",
                        )
                    self.template = self._template(options_object(message.options))
                elif kind == "rollout":
                    if self.template is None:
                        self.template = self._template({})
                    await self._add(message.rollout)
                else:
                    raise RequestError(
                        "invalid_stream",
                        "a stream message must carry options or a rollout",
                        field="kind",
                    )
                first = False
            await self._finish()
        except RequestError as exc:
            self._reject(exc)
            self.out.put_nowait(_End(exc))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("internal error reading a stream")
            self.out.put_nowait(_End(internal=True))

    def _template(self, options: dict[str, Any]) -> ComputeRequest:
        """The stream's options, checked once: every group's request is this with its batch."""
        none = np.zeros(0, dtype=np.int64)
        empty = RolloutBatch.from_flat(none, np.zeros(1, dtype=np.int64), [], none, none)
        template = parse_request(options, decode_groups=lambda groups, vocab: empty)
        # Every group of the stream is in this namespace: one check for the whole stream.
        self.principal.authorize(template.namespace)
        return template

    async def _add(self, message: pb.Rollout) -> None:
        gid = message.group_id
        remaining = self.failed.get(gid)
        if remaining is not None:
            # The rest of a group already answered with an error: drop it quietly.
            if remaining <= 1:
                del self.failed[gid]
            else:
                self.failed[gid] = remaining - 1
            return
        group = self.pending.get(gid)
        index = len(group.rollouts) if group is not None else 0
        try:
            group = self._open(message) if group is None else group
            if message.group_size != group.size:
                raise RequestError(
                    "invalid_value",
                    f"group_size is {message.group_size}, but earlier rollouts of the group "
                    f"gave {group.size}",
                    group_id=gid,
                    rollout_index=index,
                    field="group_size",
                )
            if message.rollout_id and message.rollout_id in group.rollout_ids:
                raise RequestError(
                    "duplicate_rollout",
                    f"rollout_id {message.rollout_id!r} appears twice in the group",
                    group_id=gid,
                    rollout_index=index,
                    field="rollout_id",
                )
            rollout = decode_rollout(message, index)
            held = self.pending_tokens + rollout.tokens.size
            if held > self.limits.max_pending_tokens:
                raise LimitExceeded(
                    f"incomplete groups on this stream would hold {held} tokens; the limit is "
                    f"{self.limits.max_pending_tokens} (ADV_STREAM_MAX_PENDING_TOKENS): finish "
                    "groups before sending more",
                    group_id=gid,
                    rollout_index=index,
                    field="tokens",
                )
        except RequestError as exc:
            await self._fail(gid, exc, message)
            return
        group.rollouts.append(rollout)
        group.tokens += rollout.tokens.size
        self.pending_tokens += rollout.tokens.size
        if len(group.rollouts) == group.size:
            self._close(group)
            group.completed_at = time.perf_counter()
            await self.outstanding.acquire()
            task = asyncio.create_task(self._compute(group))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def _open(self, message: pb.Rollout) -> _Group:
        """A new pending group for the message's group id (checks id, size and the limit)."""
        gid = message.group_id
        if not gid:
            raise RequestError(
                "invalid_value", "group_id must be a non-empty string", field="group_id"
            )
        size = message.group_size
        if size < 1:
            raise RequestError(
                "invalid_value",
                "group_size must be at least 1",
                group_id=gid,
                rollout_index=0,
                field="group_size",
            )
        if size > self.settings.max_group_size:
            raise LimitExceeded(
                f"group {gid!r} has {size} rollouts; the limit is "
                f"{self.settings.max_group_size} (ADV_MAX_GROUP_SIZE)",
                group_id=gid,
                field="group_size",
            )
        if len(self.pending) >= self.limits.max_pending_groups:
            raise LimitExceeded(
                f"the stream has {len(self.pending)} incomplete groups; the limit is "
                f"{self.limits.max_pending_groups} (ADV_STREAM_MAX_PENDING_GROUPS): finish "
                "groups before starting more",
                group_id=gid,
                rollout_index=0,
                field="group_id",
            )
        group = _Group(gid, size)
        self.pending[gid] = group
        self.metrics.stream_pending_groups.inc()
        return group

    def _close(self, group: _Group) -> None:
        """Take a group out of the pending state (complete or failed)."""
        if self.pending.pop(group.group_id, None) is not None:
            self.pending_tokens -= group.tokens
            self.metrics.stream_pending_groups.dec()

    async def _fail(self, gid: str, exc: RequestError, message: pb.Rollout) -> None:
        """Answer the group with ``exc``, drop what it holds, and drop its later rollouts."""
        group = self.pending.get(gid)
        ids = [*(group.rollout_ids if group is not None else []), message.rollout_id]
        received = len(ids)
        expected = group.size if group is not None else message.group_size
        if group is not None:
            self._close(group)
        if gid and expected > received:
            self.failed[gid] = expected - received
            while len(self.failed) > self.limits.max_pending_groups:
                self.failed.popitem(last=False)
        self._reject(exc)
        await self._answer(group_error(gid, exc, ids))

    def _reject(self, exc: RequestError) -> None:
        """Count a group answered with an error before it reached the engine."""
        label = self.template.estimator.label if self.template is not None else UNKNOWN_ESTIMATOR
        self.engine.record_rejection(
            TRANSPORT,
            exc.status,
            exc.code,
            label,
            principal=self.principal,
            namespace=self.template.namespace if self.template is not None else None,
        )

    async def _answer(self, response: pb.StreamResponse) -> None:
        await self.outstanding.acquire()
        self.out.put_nowait(response)

    async def _finish(self) -> None:
        """The client half-closed: let computing groups finish, then answer the incomplete."""
        if self.tasks:
            await asyncio.gather(*self.tasks)
        for group in list(self.pending.values()):
            self._close(group)
            exc = RequestError(
                "incomplete_group",
                f"group {group.group_id!r} has {len(group.rollouts)} of its {group.size} "
                "rollouts; the stream closed before the rest arrived",
                group_id=group.group_id,
                field="group_size",
            )
            self._reject(exc)
            await self._answer(group_error(group.group_id, exc, group.rollout_ids))
        self.out.put_nowait(_End())

    # ---- computing --------------------------------------------------------------------------

    async def _admit(self) -> Slot:
        """An admission slot, waited for: a stream's completed group has nowhere to be retried
        from, so it waits for a slot where a unary request would be refused. The wait is
        bounded per stream by ``max_outstanding`` (the stream stops reading meanwhile)."""
        delay = 0.001
        while True:
            if self.engine.inflight < self.settings.max_inflight:
                with contextlib.suppress(Saturated):
                    return self.engine.admit(TRANSPORT)
            await asyncio.sleep(delay)
            delay = min(2 * delay, ADMISSION_POLL_MAX_SECONDS)

    async def _compute(self, group: _Group) -> None:
        assert self.template is not None
        template = self.template

        def decode() -> ComputeRequest:
            return dataclasses.replace(
                template, batch=group.batch(template.vocab_size), request_id=uuid.uuid4().hex
            )

        try:
            with await self._admit() as slot:
                computed = await self.engine.compute(
                    decode,
                    TRANSPORT,
                    encode=partial(encode_group_result, group),
                    slot=slot,
                    started=group.completed_at,
                )
            assert computed.encoded is not None
            response = computed.encoded
        except RequestError as exc:
            response = group_error(group.group_id, exc, group.rollout_ids)
        except asyncio.CancelledError:
            self.outstanding.release()
            raise
        except Exception:
            log.exception("internal error computing stream group %r", group.group_id)
            internal = RequestError("internal", INTERNAL_MESSAGE, group_id=group.group_id)
            response = group_error(group.group_id, internal, group.rollout_ids)
        self.out.put_nowait(response)

    # ---- teardown ---------------------------------------------------------------------------

    def release(self) -> None:
        """Free everything the stream holds (on any exit, cancellation included)."""
        for task in list(self.tasks):
            task.cancel()
        for group in list(self.pending.values()):
            self._close(group)
        self.failed.clear()


class AdvantageServicer(pb_grpc.AdvantageServiceServicer):
    """``advantage.v1.AdvantageService`` on an :class:`Engine`."""

    def __init__(
        self, engine: Engine, settings: Settings, limits: StreamLimits | None = None
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.limits = limits if limits is not None else StreamLimits.from_settings(settings)
        self._estimators = estimators_message()
        self.open_streams = 0

    async def _authenticate(
        self, context: grpc.aio.ServicerContext, *, count: bool = True
    ) -> Principal:
        """The caller's principal from the ``authorization: Bearer ...`` metadata; ends the
        call with UNAUTHENTICATED otherwise (and with UNAVAILABLE once the service is closing
        for shutdown: the client retries elsewhere)."""
        if self.engine.closing:
            await abort(context, SHUTTING_DOWN)
        authorization = None
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                authorization = value.decode() if isinstance(value, bytes) else value
        try:
            return self.engine.auth.authenticate(authorization)
        except AuthError as exc:
            if count:
                self.engine.record_rejection(TRANSPORT, exc.status, exc.code)
            else:
                self.engine.log_access(TRANSPORT, exc.status, exc.code)
            await abort(context, exc)
            raise  # unreachable: abort raises

    async def Compute(
        self, request: pb.ComputeRequest, context: grpc.aio.ServicerContext
    ) -> pb.ComputeResponse:
        started = time.perf_counter()
        principal = await self._authenticate(context)
        if isinstance(request, Malformed):
            error = request.error()
            self.engine.record_rejection(TRANSPORT, error.status, error.code, principal=principal)
            await abort(context, error)
        try:
            computed = await self.engine.compute(
                partial(decode_compute_request, request),
                TRANSPORT,
                encode=encode_compute_response,
                started=started,
                principal=principal,
            )
        except (RequestError, Saturated) as exc:
            await abort(context, exc)
            raise  # unreachable: abort raises
        except Exception:
            log.exception("internal error in Compute")
            await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
            raise
        assert computed.encoded is not None
        return computed.encoded

    async def StreamCompute(
        self,
        request_iterator: AsyncIterator[pb.StreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.StreamResponse]:
        principal = await self._authenticate(context)
        if self.open_streams >= self.settings.stream_max_open:
            refused = RequestError(
                "saturated",
                f"{self.open_streams} streams are open; the limit is "
                f"{self.settings.stream_max_open} (ADV_STREAM_MAX_OPEN): retry later",
                field="streams",
                status=429,
            )
            self.engine.record_rejection(TRANSPORT, refused.status, refused.code)
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                refused.message,
                trailing_metadata=(*error_metadata(refused), (RETRY_AFTER_KEY, "1")),
            )
        session = _StreamSession(self, principal)
        metrics = self.engine.metrics
        self.open_streams += 1
        metrics.stream_open.inc()
        reader = asyncio.create_task(session.read(request_iterator))
        try:
            while not isinstance(item := await session.out.get(), _End):
                yield item
                session.outstanding.release()
            if item.internal:
                await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
            if item.error is not None:
                await abort(context, item.error)
        finally:
            reader.cancel()
            session.release()
            self.open_streams -= 1
            metrics.stream_open.dec()

    async def ListEstimators(
        self, request: pb.ListEstimatorsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListEstimatorsResponse:
        await self._authenticate(context, count=False)
        if isinstance(request, Malformed):
            await abort(context, request.error())
        return self._estimators


# ---- the server --------------------------------------------------------------------------------


@dataclass
class _Running:
    health: health_aio.HealthServicer
    port: int


_RUNNING: weakref.WeakKeyDictionary[grpc.aio.Server, _Running] = weakref.WeakKeyDictionary()


def server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    """TLS credentials from ``tls_cert``/``tls_key`` (mutual TLS with ``tls_client_ca``);
    None without TLS."""
    if not settings.tls_cert or not settings.tls_key:
        return None

    def read(path: str) -> bytes:
        with open(path, "rb") as handle:
            return handle.read()

    ca = read(settings.tls_client_ca) if settings.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(read(settings.tls_key), read(settings.tls_cert))],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


def server_options(settings: Settings) -> list[tuple[str, Any]]:
    return [
        # The body limit of HTTP, for the same payload: over it gRPC answers RESOURCE_EXHAUSTED.
        ("grpc.max_receive_message_length", settings.max_body_bytes),
        ("grpc.max_send_message_length", -1),
        # Refuse to share a port with another process (gRPC's default on Linux allows it).
        ("grpc.so_reuseport", 0),
    ]


async def start_grpc_server(
    engine: Engine,
    settings: Settings,
    host: str,
    port: int,
    *,
    limits: StreamLimits | None = None,
) -> grpc.aio.Server:
    """Start ``AdvantageService``, the health service (SERVING once started) and server
    reflection on ``host:port`` (0: a free port; :func:`bound_port` tells which), on the
    running event loop. Stop it with :func:`stop_grpc_server`."""
    # Calls beyond max_connections are refused (RESOURCE_EXHAUSTED) before their message is
    # held: what the server holds for calls it has not admitted stays bounded.
    server = grpc.aio.server(
        options=server_options(settings), maximum_concurrent_rpcs=settings.max_connections
    )
    add_servicer(AdvantageServicer(engine, settings, limits), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    credentials = server_credentials(settings)
    try:
        bound = (
            server.add_secure_port(address, credentials)
            if credentials is not None
            else server.add_insecure_port(address)
        )
    except RuntimeError as exc:
        raise RuntimeError(f"cannot listen for gRPC on {address}: {exc}") from exc
    await server.start()
    for service in ("", SERVICE_NAME):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    _RUNNING[server] = _Running(health, bound)
    log.info("gRPC on %s:%d%s", host, bound, " (TLS)" if credentials is not None else "")
    return server


def bound_port(server: grpc.aio.Server) -> int:
    """The port a server from :func:`start_grpc_server` listens on."""
    return _RUNNING[server].port


async def stop_serving(server: grpc.aio.Server) -> None:
    """Report NOT_SERVING on the health service (calls are still served)."""
    running = _RUNNING.get(server)
    if running is not None:
        await running.health.enter_graceful_shutdown()


async def stop_grpc_server(server: grpc.aio.Server, grace: float | None) -> None:
    """Report NOT_SERVING, refuse new calls, and give calls in flight ``grace`` seconds."""
    await stop_serving(server)
    _RUNNING.pop(server, None)
    await server.stop(grace)
