"""Messages of ``advantage.v1`` to and from the engine's types: raw little-endian tensors,
requests, responses, errors (status codes and trailing metadata), and messages that do not
parse."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from advantage_contract import grpc_wire as contract_wire
from advantage_contract.errors import AdvantageError
from advantage_contract.fields import EXACT_INTEGER_LIMIT, REWARD_COMPONENTS_FIELD
from advantage_contract.flat import check_prompt_key, prompt_ids
from advantage_contract.grpc_gen import advantage_pb2 as pb
from advantage_contract.grpc_wire import WIRE_DTYPES
from google.protobuf.message import DecodeError

from ..batch import TOKEN_INPUTS, RolloutBatch
from ..config import RequestLimits
from ..errors import LimitExceeded, Overloaded, RequestError
from ..estimators import AdvantageResult
from ..wire import jsonio
from ..wire.listing import estimator_listing
from ..wire.request import (
    MAX_ESTIMATOR_JSON_BYTES,
    MAX_IGNORE_TOKEN_IDS,
    MAX_RETURN_NAMES,
    ComputeRequest,
    parse_options,
)
from .grpc_wire import invalid_text_field, malformed
from .guards import PRE_PARSERS
from .openapi import EstimatorListing

TRANSPORT = "grpc"
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["AdvantageService"].full_name

INTERNAL_MESSAGE = "internal error; see the service log"
# The longest status message sent, in UTF-8 bytes: grpc-message is percent-encoded (a byte
# outside printable ASCII takes 3), and with the trailing metadata it must stay well under
# the 8 KiB of headers a client accepts, or the client sees RESOURCE_EXHAUSTED instead.
MAX_STATUS_BYTES = 1024
SHUTTING_DOWN = RequestError(
    "shutting_down", "the service is shutting down; retry on another replica", status=503
)


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
    """The wire options as the HTTP JSON request's top-level fields (without ``groups``), the
    sizes of its lists and of its estimator JSON checked before they are expanded."""
    if len(options.estimator_json) > MAX_ESTIMATOR_JSON_BYTES:
        raise RequestError(  # (grpc_wire's answer to the same)
            "invalid_parameter",
            f"estimator_json has {len(options.estimator_json)} characters; an estimator is at "
            f"most {MAX_ESTIMATOR_JSON_BYTES}",
            field="estimator_json",
        )
    if len(options.ignore_token_ids) > MAX_IGNORE_TOKEN_IDS:
        raise LimitExceeded(
            f"ignore_token_ids has {len(options.ignore_token_ids)} ids; the limit is "
            f"{MAX_IGNORE_TOKEN_IDS}",
            field="ignore_token_ids",
        )
    if len(options.returns) > MAX_RETURN_NAMES:
        raise RequestError(
            "invalid_parameter",
            f"returns lists {len(options.returns)} names; at most {MAX_RETURN_NAMES} may be "
            "asked for",
            field="return",
        )
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


def decode_compute_message(data: bytes, limits: RequestLimits) -> ComputeRequest:
    """A unary request's wire bytes as a validated :class:`ComputeRequest`: checked against
    ``limits`` from the bytes (the gRPC pre-parser of transports/guards.py), then parsed and
    decoded. Fields unknown to this version are skipped and not kept (protobuf's parse holds
    them in the message, which is dropped once decoded; nothing of them reaches the request or
    the answer)."""
    PRE_PARSERS["grpc"](data, limits)
    try:
        request = pb.ComputeRequest.FromString(data)
    except DecodeError as exc:
        raise parse_error(pb.ComputeRequest, data, exc) from exc
    return decode_compute_request(request)


def parse_error(message: Any, data: bytes, exc: DecodeError) -> RequestError:
    """Why ``data`` does not parse as ``message`` (a message class): a string field that is
    not UTF-8, named (422 ``invalid_text``, as the same string is over HTTP), else
    ``invalid_protobuf``."""
    return invalid_text_field(message.DESCRIPTOR, data) or malformed(str(exc))


def decode_compute_request(request: pb.ComputeRequest) -> ComputeRequest:
    """A unary request as a validated :class:`ComputeRequest` (the JSON contract's checks)."""
    options = parse_options(options_object(request.options, request.request_id))
    group_ids = list(request.group_ids)
    group_index = read_tensor(_required(request, "group_index"), "group_index", integer=True)
    rewards = read_tensor(_required(request, "rewards"), "rewards", integer=False)
    _check_integer_rewards(rewards, group_ids, group_index)
    batch = RolloutBatch.from_flat(
        tokens=read_tensor(_required(request, "tokens"), "tokens", integer=True),
        offsets=read_tensor(_required(request, "offsets"), "offsets", integer=True),
        group_ids=group_ids,
        group_index=group_index,
        rewards=rewards,
        teacher_logprobs={
            name: read_tensor(values, f"teacher_logprobs.{name}", integer=False)
            for name, values in sorted(request.teacher_logprobs.items())
        },
        vocab_size=options.vocab_size,
        prompt_ids=_prompt_ids(request),
        reward_components={
            name: read_tensor(values, f"{REWARD_COMPONENTS_FIELD}.{name}", integer=False)
            for name, values in sorted(request.reward_components.items())
        },
        **{
            name: read_tensor(getattr(request, name), name, integer=False)
            for name in TOKEN_INPUTS
            if request.HasField(name)
        },
    )
    return options.with_batch(batch)


def _prompt_ids(request: pb.ComputeRequest) -> list[str] | None:
    """Per group, the key of its history: ``prompt_keys`` (parallel to ``group_ids``; an empty
    string gives none) where given, else None (the group ids key it)."""
    keys = list(request.prompt_keys)
    if not keys:
        return None
    group_ids = list(request.group_ids)
    if len(keys) != len(group_ids):
        raise RequestError(
            "invalid_shape",
            f"prompt_keys has {len(keys)} entries for {len(group_ids)} group_ids: give one per "
            "group (an empty string for none) or none at all",
            field="prompt_keys",
        )
    try:
        for gid, key in zip(group_ids, keys, strict=True):
            check_prompt_key(key, group_id=gid)
    except AdvantageError as exc:
        raise RequestError.from_contract(exc, field="prompt_keys") from exc  # (its proto name)
    return prompt_ids(group_ids, [key or None for key in keys])


def _check_integer_rewards(
    rewards: np.ndarray, group_ids: list[str], group_index: np.ndarray
) -> None:
    """Integer rewards (an int64 tensor) beyond 2**53 would be rounded: refused, as JSON
    refuses them, naming the group and rollout."""
    if rewards.dtype.kind != "i" or not rewards.size:
        return
    beyond = np.flatnonzero((rewards > EXACT_INTEGER_LIMIT) | (rewards < -EXACT_INTEGER_LIMIT))
    if not beyond.size:
        return
    i = int(beyond[0])
    where: dict[str, Any] = {}
    if i < group_index.size and 0 <= int(group_index[i]) < len(group_ids):
        g = int(group_index[i])
        where = {
            "group_id": group_ids[g],
            "rollout_index": int(np.count_nonzero(group_index[:i] == g)),
        }
    raise RequestError(
        "invalid_value",
        "reward is an integer beyond 2**53 (9007199254740992), which a float64 cannot hold "
        "exactly; send it as a float",
        field="reward",
        **where,
    )


def summary_message(summary: Mapping[str, Any]) -> pb.Summary:
    """The summary's fields the message has (a newer summary key is not an error here)."""
    fields = pb.Summary.DESCRIPTOR.fields_by_name
    message = pb.Summary(
        **{
            k: v
            for k, v in summary.items()
            if k in fields and v is not None and k != REWARD_COMPONENTS_FIELD
        }
    )
    for name, stats in (summary.get(REWARD_COMPONENTS_FIELD) or {}).items():
        # (None, no value to take the statistic of: NaN on the wire)
        entry = message.reward_components[name]
        entry.mean = math.nan if stats["mean"] is None else stats["mean"]
        entry.std = math.nan if stats["std"] is None else stats["std"]
    return message


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
    408: grpc.StatusCode.DEADLINE_EXCEEDED,  # the request message did not arrive in time
    409: grpc.StatusCode.ALREADY_EXISTS,  # a request id counted before for another request
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,  # overloaded (or shutting down): retry, elsewhere or later
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def status_code(exc: RequestError) -> grpc.StatusCode:
    """422 -> INVALID_ARGUMENT; 413 -> RESOURCE_EXHAUSTED; 503 (overloaded) -> UNAVAILABLE;
    401 -> UNAUTHENTICATED; 403 -> PERMISSION_DENIED; 408 and 504 -> DEADLINE_EXCEEDED."""
    return STATUS_CODES.get(exc.status, grpc.StatusCode.INVALID_ARGUMENT)


def error_metadata(exc: RequestError) -> contract_wire.Metadata:
    """Trailing metadata locating the error (keys in the .proto's header comment), with an
    overload's retry hint."""
    if isinstance(exc, Overloaded):
        return contract_wire.error_metadata(exc, exc.retry_after_seconds, exc.retry_after_ms)
    return contract_wire.error_metadata(exc)


def error_message(exc: RequestError) -> pb.Error:
    error = pb.Error(
        code=exc.code, message=exc.message, group_id=exc.group_id or "", field=exc.field or ""
    )
    if exc.rollout_index is not None:
        error.rollout_index = exc.rollout_index
    return error


def status_message(message: str) -> str:
    """``message`` cut to :data:`MAX_STATUS_BYTES` of UTF-8 (on a character boundary)."""
    data = message.encode()
    if len(data) <= MAX_STATUS_BYTES:
        return message
    return data[:MAX_STATUS_BYTES].decode(errors="ignore") + "... (cut)"


async def abort(context: grpc.aio.ServicerContext, exc: RequestError) -> None:
    """End the call with the error's status, message and trailing metadata (raises)."""
    await context.abort(
        status_code(exc), status_message(exc.message), trailing_metadata=error_metadata(exc)
    )


# ---- messages that do not parse ----------------------------------------------------------------


@dataclass(frozen=True)
class Malformed:
    """A request message whose bytes are not the message (what the lenient deserializers give
    instead of raising: gRPC would answer UNKNOWN, or INTERNAL inside a stream)."""

    message: str
    # Set when a string field is not UTF-8: the refusal naming it (invalid_text_field).
    refusal: RequestError | None = None

    def error(self) -> RequestError:
        if self.refusal is not None:
            return self.refusal
        return RequestError(
            "invalid_protobuf",
            f"the request message does not parse: {self.message}",
            field="message",
        )


def lenient(message: Any) -> Any:
    """``message``'s FromString (a message class) returning :class:`Malformed` on corrupt
    bytes."""

    def deserialize(data: bytes) -> Any:
        try:
            return message.FromString(data)
        except DecodeError as exc:
            return Malformed(str(exc), invalid_text_field(message.DESCRIPTOR, data))

    return deserialize
