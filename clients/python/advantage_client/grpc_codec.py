"""The gRPC messages of ``advantage.v1.AdvantageService`` to and from numpy arrays and the
HTTP API's dicts, and the service's errors (status, details, trailing metadata) as
:class:`AdvantageError`.

No channel and no calls here: :mod:`advantage_client.grpc_client` sends what this module
builds, and :mod:`advantage_client.grpc_stream` keeps the stream's rollouts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from advantage_contract.arrays import to_number, values_1d
from advantage_contract.errors import AdvantageError
from advantage_contract.flat import (
    TOKEN_FIELDS,
    is_number,
    narrow_tokens,
    nest_rows,
    split_rows,
    token_array,
)
from advantage_contract.grpc_gen import advantage_pb2 as pb
from advantage_contract.grpc_wire import DTYPE_OF, WIRE_DTYPES, error_from_metadata
from advantage_contract.padded import FlatRequest, PaddedResult, WireRequest, result_from_flat
from advantage_contract.rewards import check_component_name, check_reward

STREAM_ROLLOUT_FIELDS = (
    "group_id",
    "group_size",
    "rollout_id",
    "tokens",
    "reward",
    *TOKEN_FIELDS,
    "teacher_logprobs",
    "prompt_key",
    "reward_components",
)


def to_tensor(values: np.ndarray) -> pb.Tensor:
    """A 1-D array as raw little-endian bytes with its dtype."""
    array = np.asarray(values)
    dtype = array.dtype.newbyteorder("=")
    if dtype not in DTYPE_OF:
        dtype = np.dtype(np.int64 if array.dtype.kind in "iub" else np.float64)
    wire = DTYPE_OF[dtype]
    data = np.ascontiguousarray(array, dtype=WIRE_DTYPES[wire]).tobytes()
    return pb.Tensor(dtype=wire, data=data)


def from_tensor(tensor: pb.Tensor) -> np.ndarray:
    """A wire tensor as a native numpy array (a view of the message's bytes, read-only)."""
    array = np.frombuffer(tensor.data, dtype=WIRE_DTYPES[tensor.dtype])
    return array.astype(array.dtype.newbyteorder("="), copy=False)


def options_message(
    *,
    namespace: str | None = None,
    estimator: Any = None,
    ignore_token_ids: Sequence[int] | None = None,
    vocab_size: int | None = None,
    returns: Sequence[str] | None = None,
) -> pb.ComputeOptions:
    """The JSON request's options: ``estimator`` a preset name or an estimator object. A value
    the message's field would change or refuse (a float vocab_size truncated, a string
    ``return`` split into letters) is the error the service answers the JSON request, with its
    code and field, not a coercion or protobuf's TypeError."""
    options = pb.ComputeOptions(namespace=_text(namespace, "namespace"))
    if isinstance(estimator, str):
        options.preset = estimator
    elif estimator is not None:
        try:
            options.estimator_json = json.dumps(estimator)
        except (TypeError, ValueError) as exc:
            raise AdvantageError("invalid_type", f"estimator: {exc}", field="estimator") from None
    if ignore_token_ids:
        options.ignore_token_ids.extend(_integers(ignore_token_ids, "ignore_token_ids"))
    if vocab_size is not None:
        (options.vocab_size,) = _integers([vocab_size], "vocab_size", positive=True)
    if returns:
        if isinstance(returns, str) or not all(isinstance(n, str) for n in returns):
            raise AdvantageError("invalid_type", "return must be a list of names", field="return")
        options.returns.extend(returns)
    return options


def _text(value: Any, field: str) -> str:
    """An optional string option ('' for none)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise AdvantageError("invalid_type", f"{field} must be a string", field=field)
    return value


def _integers(values: Any, field: str, *, positive: bool = False) -> list[int]:
    """Integers an int64 field carries (no bool, no float: the service refuses them in JSON),
    refused as the service words it (``invalid_type`` naming ``field``)."""
    kind = "a positive integer" if positive else "a list of 64-bit integers"
    out = []
    for value in values:
        if (
            isinstance(value, bool)
            or not isinstance(value, int | np.integer)
            or not -(2**63) <= value < 2**63
            or (positive and value <= 0)
        ):
            raise AdvantageError("invalid_type", f"{field} must be {kind}", field=field)
        out.append(int(value))
    return out


def compute_request_message(request: Mapping[str, Any]) -> pb.ComputeRequest:
    """The HTTP JSON request (lists or numpy arrays inside) as a ``ComputeRequest``."""
    return request_message(WireRequest.from_json(request))


def flat_request_message(req: FlatRequest) -> pb.ComputeRequest:
    """A padded call's flat arrays as a ``ComputeRequest`` (raw tensors, trainer's row order)."""
    return request_message(req.wire())


def request_message(wire: WireRequest) -> pb.ComputeRequest:
    """A request's flat arrays as a ``ComputeRequest`` of raw tensors."""
    rows, options = wire.rows, wire.options
    message = pb.ComputeRequest(
        request_id=_text(options.get("request_id"), "request_id"),
        options=options_message(
            namespace=options.get("namespace"),
            estimator=options.get("estimator"),
            ignore_token_ids=options.get("ignore_token_ids"),
            vocab_size=options.get("vocab_size"),
            returns=options.get("return"),
        ),
        group_ids=rows.group_ids,
        group_index=to_tensor(rows.group_index),
        offsets=to_tensor(rows.offsets),
        tokens=to_tensor(wire.tokens),
        rewards=to_tensor(rows.rewards),
    )
    if wire.prompt_keys is not None:
        message.prompt_keys.extend(key or "" for key in wire.prompt_keys)
    for name, values in wire.per_token.items():
        getattr(message, name).CopyFrom(to_tensor(values))
    for name, values in wire.teacher_logprobs.items():
        message.teacher_logprobs[name].CopyFrom(to_tensor(values))
    for name, values in wire.reward_components.items():
        message.reward_components[name].CopyFrom(to_tensor(values))
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
    if summary.reward_components:
        # (NaN on the wire: null in the JSON answer)
        out["reward_components"] = {
            name: {"mean": _finite(stats.mean), "std": _finite(stats.std)}
            for name, stats in summary.reward_components.items()
        }
    return out


def _finite(value: float) -> float | None:
    return value if np.isfinite(value) else None


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
    ``is_weights``, ``teacher_logprobs``, ``prompt_key`` and ``reward_components``: name -> a
    number or None; ``reward`` may then be left out) as a ``Rollout``."""
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
    size = to_number(rollout.get("group_size"))
    if not isinstance(size, int | np.integer) or isinstance(size, bool) or size < 1:
        raise AdvantageError(
            "invalid_type",
            f"group_size must be a positive integer, got {size!r}",
            field="group_size",
            **where,
        )
    if "tokens" not in rollout:
        raise AdvantageError("missing_input", "tokens is required", field="tokens", **where)
    reward = to_number(rollout.get("reward"))
    components = rollout.get("reward_components")
    if not is_number(reward) and not (reward is None and components is not None):
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
        prompt_key=key or "",
    )
    if reward is not None:
        message.reward = float(reward)
    if components is not None:
        _put_components(message, components, where)
    for name in TOKEN_FIELDS:
        if rollout.get(name) is not None:
            values = values_1d(rollout[name], name, np.float32)
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
            to_tensor(values_1d(values, f"teacher_logprobs.{name}", np.float32))
        )
    return message


def _put_components(message: pb.Rollout, components: Any, where: dict[str, Any]) -> None:
    """A stream rollout's ``reward_components`` (name -> number or None) into ``message``."""
    if not isinstance(components, Mapping):
        raise AdvantageError(
            "invalid_type",
            "reward_components must map component names to numbers (or None)",
            field="reward_components",
            **where,
        )
    for name, value in components.items():
        check_component_name(name, **where)
        value = to_number(value)
        entry = message.reward_components[name]
        if value is None or (isinstance(value, float) and np.isnan(value)):
            entry.SetInParent()  # (present, without a value: None)
            continue
        check_reward(value, f"reward_components.{name}", where)
        entry.value = float(value)


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


# gRPC's refusal of a message over the server's max_receive_message_length.
TOO_LARGE = "received message larger than max"


def error_from_rpc(exc: grpc.RpcError) -> AdvantageError:
    """The service's error (status details + trailing metadata) as an AdvantageError, with its
    retry hints: ``retry-after`` (seconds) and ``retry-after-ms``."""
    call: Any = exc
    code = call.code()
    metadata = (call.trailing_metadata() or ()) if hasattr(call, "trailing_metadata") else ()
    error = error_from_metadata(code.name, call.details(), metadata)
    if error.code == "resource_exhausted" and TOO_LARGE in str(error.message).lower():
        # gRPC's own refusal of a message over the server's limit, before the service sees it:
        # the error HTTP answers for a body over the same limit (ADV_MAX_BODY_BYTES).
        return AdvantageError(
            "limit_exceeded",
            f"{error.message} (the service's ADV_MAX_BODY_BYTES)",
            field="body",
            grpc_code=error.grpc_code,
        )
    return error


# gRPC's own refusal of a call past the server's limit of calls at once (ADV_MAX_CONNECTIONS),
# RESOURCE_EXHAUSTED without the service's error code: HTTP answers the same limit 503.
CALL_LIMIT = "concurrent rpc limit exceeded"


def is_retryable(error: AdvantageError) -> bool:
    """UNAVAILABLE (overloaded, no server yet, a restart), and overload under any status:
    ``overloaded``, ``saturated`` (RESOURCE_EXHAUSTED, HTTP's 429, from services before
    UNAVAILABLE), or gRPC's refusal past the server's calls at once (:data:`CALL_LIMIT`)."""
    return (
        error.grpc_code == "UNAVAILABLE"
        or error.code in ("overloaded", "saturated")
        or (error.code == "resource_exhausted" and CALL_LIMIT in str(error.message).lower())
    )
