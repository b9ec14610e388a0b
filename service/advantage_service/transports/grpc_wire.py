"""A unary ``ComputeRequest`` checked from its wire bytes before protobuf parses it.

protobuf copies every string and bytes field it parses, and reading a bytes field copies it
again, so a message is refused here, from the lengths its wire format states, before anything
of it is built: the rollouts, groups and tokens (from the byte lengths and dtypes of its
tensors), every per-token array's values, each group's size (from a view of ``group_index``),
the ids and names (the lengths of the JSON contract: ``wire.request``), the teacher conditions,
``returns``, ``ignore_token_ids`` and ``estimator_json``. What is not a limit (dtypes, shapes,
values) is left to the decoder, which names it as before.

Fields this version does not know are skipped, as protobuf skips them: a newer client's
message is computed (forward compatibility), within the message size limit. Nothing of them
is kept: the request is built from the known fields only, and the answer carries none.

The scan follows protobuf's rules where they matter for a count: a message field given twice
is merged (a tensor's last ``data`` and last ``dtype`` win), a map entry given twice keeps its
last value, repeated fields add up.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from advantage_contract.fields import (
    MAX_COMPONENT_NAME_LENGTH,
    MAX_CONDITION_NAME_LENGTH,
    MAX_GROUP_ID_LENGTH,
    MAX_REWARD_COMPONENTS,
    MAX_TEACHER_CONDITIONS,
    REWARD_COMPONENTS_FIELD,
    TOKEN_FIELDS,
)
from advantage_contract.grpc_gen import advantage_pb2 as pb
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from ..config import RequestLimits
from ..errors import SPLIT_HINT, LimitExceeded, RequestError
from ..wire.request import (
    MAX_ESTIMATOR_JSON_BYTES,
    MAX_IGNORE_TOKEN_IDS,
    MAX_NAME_LENGTH,
    MAX_NAMESPACE_LENGTH,
    MAX_REQUEST_ID_LENGTH,
    MAX_RETURN_NAMES,
)
from ..wire.text import invalid_utf8

# Field numbers of advantage.v1, read off the generated descriptors (the .proto is their one
# source): the request's layout tensors and the contract's per-token inputs.
_REQUEST = pb.ComputeRequest.DESCRIPTOR.fields_by_name
_OPTIONS = pb.ComputeOptions.DESCRIPTOR.fields_by_name
REQUEST_ID, OPTIONS, GROUP_IDS, TEACHER_LOGPROBS, PROMPT_KEYS, REWARD_COMPONENTS = (
    _REQUEST[name].number
    for name in (
        "request_id",
        "options",
        "group_ids",
        "teacher_logprobs",
        "prompt_keys",
        REWARD_COMPONENTS_FIELD,
    )
)
TENSORS = {
    _REQUEST[name].number: name
    for name in ("group_index", "offsets", "tokens", "rewards", *TOKEN_FIELDS)
}
NAMESPACE, PRESET, ESTIMATOR_JSON, IGNORE_TOKEN_IDS, RETURNS = (
    _OPTIONS[name].number
    for name in ("namespace", "preset", "estimator_json", "ignore_token_ids", "returns")
)
TENSOR_DTYPE, TENSOR_DATA = 1, 2
MAP_KEY, MAP_VALUE = 1, 2
# Bytes per value of each DType (advantage.v1.DType: INT32, INT64, FLOAT32, FLOAT64).
ITEM_SIZES = {1: 4, 2: 8, 3: 4, 4: 8}
INTEGER_DTYPES: dict[int, np.dtype[Any]] = {1: np.dtype("<i4"), 2: np.dtype("<i8")}
VARINT, I64, LEN, SGROUP, EGROUP, I32 = 0, 1, 2, 3, 4, 5


# The name callers knew the limits by: every transport's now (transports/guards.py).
MessageLimits = RequestLimits


@dataclass(frozen=True)
class MessageShape:
    """What the scan counted of a message: its rollouts and tokens."""

    rollouts: int
    tokens: int


class _Truncated(Exception):
    """The wire bytes end inside a field or are not protobuf."""


def malformed(why: str) -> RequestError:
    return RequestError(
        "invalid_protobuf", f"the request message does not parse: {why}", field="message"
    )


# ---- the wire format ---------------------------------------------------------------------------


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _Truncated("a varint runs past its field")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def fields(data: bytes, pos: int, end: int) -> Any:
    """(number, wire type, value, start, stop) of each field in data[pos:end]: ``value`` is a
    varint's value, ``start:stop`` a length-delimited field's payload. Groups (deprecated, never
    in advantage.v1) are skipped whole."""
    while pos < end:
        tag, pos = _varint(data, pos, end)
        number, kind = tag >> 3, tag & 7
        if number == 0:
            raise _Truncated("field number 0")
        if kind == VARINT:
            value, pos = _varint(data, pos, end)
            yield number, kind, value, pos, pos
        elif kind == LEN:
            size, pos = _varint(data, pos, end)
            if size > end - pos:
                raise _Truncated(f"field {number} says {size} bytes; {end - pos} are left")
            yield number, kind, 0, pos, pos + size
            pos += size
        elif kind in (I64, I32):
            pos += 8 if kind == I64 else 4
            if pos > end:
                raise _Truncated(f"field {number} runs past the message")
        elif kind == SGROUP:
            pos = _skip_group(data, pos, end, number)
        else:
            raise _Truncated(f"field {number} has wire type {kind}")


def _skip_group(data: bytes, pos: int, end: int, number: int) -> int:
    depth = 1
    while True:
        if pos >= end:
            raise _Truncated(f"group {number} does not end")
        tag, pos = _varint(data, pos, end)
        kind = tag & 7
        if kind == SGROUP:
            depth += 1
        elif kind == EGROUP:
            depth -= 1
            if depth == 0:
                return pos
        elif kind == VARINT:
            _, pos = _varint(data, pos, end)
        elif kind == LEN:
            size, pos = _varint(data, pos, end)
            pos += size
        elif kind in (I64, I32):
            pos += 8 if kind == I64 else 4
        else:
            raise _Truncated(f"wire type {kind} in group {number}")


def over(data: bytes, start: int, stop: int, limit: int) -> str | None:
    """How the UTF-8 string data[start:stop] is longer than ``limit`` characters, for an error
    message ("300 characters"); None when it is not (or is not UTF-8: protobuf refuses that)."""
    size = stop - start
    if size <= limit:
        return None
    if size > 4 * limit:  # (a character is at most 4 bytes: not worth decoding)
        return f"more than {limit} characters ({size} bytes)"
    try:
        length = len(data[start:stop].decode())
    except UnicodeDecodeError:
        return None
    return f"{length} characters" if length > limit else None


@dataclass
class _Tensor:
    dtype: int = 0
    start: int = 0
    stop: int = 0

    def merge(self, data: bytes, start: int, stop: int) -> None:
        for number, kind, value, a, b in fields(data, start, stop):
            if number == TENSOR_DTYPE and kind == VARINT:
                self.dtype = value
            elif number == TENSOR_DATA and kind == LEN:
                self.start, self.stop = a, b

    def count(self) -> int:
        """Its values (0 for an unknown dtype: the decoder names that)."""
        size = ITEM_SIZES.get(self.dtype)
        return (self.stop - self.start) // size if size else 0


@dataclass
class _Request:
    tensors: dict[str, _Tensor] = field(default_factory=dict)
    teachers: dict[bytes, _Tensor] = field(default_factory=dict)
    components: dict[bytes, _Tensor] = field(default_factory=dict)
    group_ids: array[int] = field(default_factory=lambda: array("q"))  # start, stop, ...


# ---- text ---------------------------------------------------------------------------------------

# A string field's path in a message -> the name errors of that field give (the JSON
# contract's, as parse_options and the stream's checks name them).
TEXT_FIELDS = {
    "options.namespace": "namespace",
    "options.preset": "estimator",
    "options.estimator_json": "estimator_json",
    "options.returns": "return",
    "rollout.group_id": "group_id",
    "rollout.rollout_id": "rollout_id",
    "rollout.prompt_key": "prompt_key",
    "rollout.teacher_logprobs": "teacher_logprobs",
    "rollout.reward_components": REWARD_COMPONENTS_FIELD,
}


def invalid_text_field(descriptor: Descriptor, data: bytes) -> RequestError | None:
    """The refusal of the first string field of a message (of type ``descriptor``, from its
    wire bytes) that is not UTF-8, naming it (``request_id``, ``group_ids[3]``,
    ``teacher_logprobs``, ``namespace``...); None when every string is (or the bytes are not
    the message: its parse error says so).

    protobuf refuses such a message whole ("String field had bad UTF-8"), without saying which
    field: this walk, run only after that refusal, finds it."""
    try:
        found = _bad_string(descriptor, data, 0, len(data), "")
    except _Truncated:
        return None
    if found is None:
        return None
    path, index, is_key, exc = found
    name = TEXT_FIELDS.get(path, path)
    field = name if index is None else f"{name}[{index}]"
    return invalid_utf8(exc, field, f"a key of {field}" if is_key else None)


def _bad_string(
    descriptor: Descriptor, data: bytes, start: int, stop: int, prefix: str
) -> tuple[str, int | None, bool, UnicodeDecodeError] | None:
    """(path, index of a repeated field's element, whether it is a map's key, the decoding
    error) of the first string field in data[start:stop] that is not UTF-8."""
    seen: dict[int, int] = {}
    for number, kind, _value, a, b in fields(data, start, stop):
        field = descriptor.fields_by_number.get(number)
        if field is None or kind != LEN:
            continue  # (unknown fields are kept as bytes: never text)
        index = seen.get(number, 0)
        seen[number] = index + 1
        path = prefix + field.name
        if field.type == FieldDescriptor.TYPE_STRING:
            try:
                data[a:b].decode("utf-8")
            except UnicodeDecodeError as exc:
                return path, index if field.is_repeated else None, False, exc
        elif field.message_type is not None:
            found = _bad_string(field.message_type, data, a, b, path + ".")
            if found is not None and field.message_type.GetOptions().map_entry:
                # (a map's entry: its key is the text; the map is named, not the entry)
                return path, None, found[0].endswith(".key"), found[3]
            if found is not None:
                return found
    return None


# ---- the check ---------------------------------------------------------------------------------


def check_compute_request(data: bytes, limits: RequestLimits) -> MessageShape:
    """Raise the error the request would get (413 over a limit, 422 for an empty or malformed
    field) from its wire bytes alone; return its counts when protobuf may parse it (the gRPC
    pre-parser of transports/guards.py)."""
    try:
        return _check(data, limits)
    except _Truncated as exc:
        raise malformed(str(exc)) from None


def _check(data: bytes, limits: RequestLimits) -> MessageShape:
    request = _Request()
    returns = ignore = 0
    for number, kind, _value, start, stop in fields(data, 0, len(data)):
        if kind != LEN:
            continue  # (a known field of the wrong wire type: protobuf refuses it)
        if number == REQUEST_ID:
            if length := over(data, start, stop, MAX_REQUEST_ID_LENGTH):
                raise LimitExceeded(
                    f"request_id has {length}; the limit is {MAX_REQUEST_ID_LENGTH}",
                    field="request_id",
                )
        elif number == OPTIONS:
            returns, ignore = _check_options(data, start, stop, returns, ignore)
        elif number == GROUP_IDS:
            _check_group_id(data, start, stop, len(request.group_ids) // 2, limits)
            request.group_ids.extend((start, stop))
        elif number in TENSORS:
            request.tensors.setdefault(TENSORS[number], _Tensor()).merge(data, start, stop)
        elif number == TEACHER_LOGPROBS:
            _check_teacher(data, start, stop, request.teachers)
        elif number == REWARD_COMPONENTS:
            _check_teacher(data, start, stop, request.components, components=True)
        elif number == PROMPT_KEYS and (length := over(data, start, stop, MAX_GROUP_ID_LENGTH)):
            # (not echoed: it is too long to be a key)
            raise LimitExceeded(
                f"a prompt key has {length}; the limit is {MAX_GROUP_ID_LENGTH}",
                field="prompt_keys",
            )
    return _check_counts(data, request, limits)


def _check_options(
    data: bytes, start: int, stop: int, returns: int, ignore: int
) -> tuple[int, int]:
    for number, kind, _value, a, b in fields(data, start, stop):
        if number == IGNORE_TOKEN_IDS:
            ignore += _varint_count(data, a, b) if kind == LEN else 1
            if ignore > MAX_IGNORE_TOKEN_IDS:
                raise LimitExceeded(
                    f"ignore_token_ids has more than {MAX_IGNORE_TOKEN_IDS} ids; the limit is "
                    f"{MAX_IGNORE_TOKEN_IDS}",
                    field="ignore_token_ids",
                )
        if kind != LEN:
            continue
        if number == NAMESPACE and over(data, a, b, MAX_NAMESPACE_LENGTH):
            raise RequestError(  # (parse_options' answer to the same)
                "invalid_type",
                f"namespace must be a non-empty string of at most {MAX_NAMESPACE_LENGTH} "
                "characters",
                field="namespace",
            )
        # (names: 422, as any name the registry lacks is; the name not echoed)
        if number == PRESET and (length := over(data, a, b, MAX_NAME_LENGTH)):
            raise RequestError(
                "unknown_estimator",
                f"preset has {length}; names are at most {MAX_NAME_LENGTH}",
                field="estimator",
            )
        if number == ESTIMATOR_JSON and b - a > MAX_ESTIMATOR_JSON_BYTES:
            raise RequestError(
                "invalid_parameter",
                f"estimator_json has {b - a} bytes; an estimator is at most "
                f"{MAX_ESTIMATOR_JSON_BYTES}",
                field="estimator_json",
            )
        if number == RETURNS:
            returns += 1
            if returns > MAX_RETURN_NAMES:
                raise RequestError(
                    "invalid_parameter",
                    f"returns lists more than {MAX_RETURN_NAMES} names; at most "
                    f"{MAX_RETURN_NAMES} may be asked for",
                    field="return",
                )
            if length := over(data, a, b, MAX_NAME_LENGTH):
                raise RequestError(
                    "invalid_parameter",
                    f"returns has a name of {length}; names are at most {MAX_NAME_LENGTH}",
                    field="return",
                )
    return returns, ignore


def _varint_count(data: bytes, start: int, stop: int) -> int:
    """The varints of a packed field: its bytes without the continuation bit."""
    size = stop - start
    if size > 10 * (MAX_IGNORE_TOKEN_IDS + 1):  # (a varint is at most 10 bytes: over the limit)
        return size // 10
    view = np.frombuffer(data, np.uint8, size, start)  # (a view; the comparison is < 656 KB)
    return int(np.count_nonzero(view < 0x80))


def _check_group_id(data: bytes, start: int, stop: int, index: int, limits: RequestLimits) -> None:
    if index >= limits.max_rollouts:  # (every group has a rollout)
        raise LimitExceeded(
            f"the request has more than {limits.max_rollouts} group_ids, and a group has at "
            f"least one rollout; the limit is {limits.max_rollouts} rollouts "
            f"(ADV_MAX_REQUEST_ROLLOUTS): {SPLIT_HINT}",
            field="group_ids",
        )
    if start == stop:
        raise RequestError(
            "invalid_value", f"group_ids[{index}] must be a non-empty string", field="group_ids"
        )
    if length := over(data, start, stop, MAX_GROUP_ID_LENGTH):  # (not echoed: too long)
        raise LimitExceeded(
            f"group_ids[{index}] has {length}; the limit is {MAX_GROUP_ID_LENGTH}",
            field="group_ids",
        )


def _check_teacher(
    data: bytes,
    start: int,
    stop: int,
    teachers: dict[bytes, _Tensor],
    components: bool = False,
) -> None:
    """A map entry of named tensors: a teacher condition, or (``components``) a reward
    component; its name's length and the count of names within the limits."""
    field, what, name_limit, count_limit = (
        (
            REWARD_COMPONENTS_FIELD,
            "reward components",
            MAX_COMPONENT_NAME_LENGTH,
            MAX_REWARD_COMPONENTS,
        )
        if components
        else (
            "teacher_logprobs",
            "teacher_logprobs conditions",
            MAX_CONDITION_NAME_LENGTH,
            MAX_TEACHER_CONDITIONS,
        )
    )
    key = b""
    value = _Tensor()
    for number, kind, _value, a, b in fields(data, start, stop):
        if number == MAP_KEY and kind == LEN:
            if length := over(data, a, b, name_limit):
                name = "reward component" if components else "teacher_logprobs condition"
                raise LimitExceeded(
                    f"a {name} name has {length}; the limit is {name_limit}", field=field
                )
            key = data[a:b]
        elif number == MAP_VALUE and kind == LEN:
            value.merge(data, a, b)  # (within an entry a message field merges ...)
    teachers[key] = value  # (... and an entry replaces one of the same key)
    if len(teachers) > count_limit:
        raise LimitExceeded(f"the request has more than {count_limit} {what}", field=field)


def _check_counts(data: bytes, request: _Request, limits: RequestLimits) -> MessageShape:
    tensors = request.tensors
    count = {name: t.count() for name, t in tensors.items()}
    rollouts = max(
        count.get("rewards", 0), count.get("group_index", 0), count.get("offsets", 0) - 1
    )
    limits.check_rollouts(rollouts)
    tokens = count.get("tokens", 0)
    limits.check_tokens(tokens)
    per_token = [(name, count.get(name, 0)) for name in TOKEN_FIELDS]
    per_token += [
        (f"teacher_logprobs.{key.decode(errors='replace')}", t.count())
        for key, t in request.teachers.items()
    ]
    for key, t in request.components.items():
        if t.count() > limits.max_rollouts:  # (one value per rollout)
            name = f"{REWARD_COMPONENTS_FIELD}.{key.decode(errors='replace')}"
            raise LimitExceeded(
                f"{name} has {t.count()} values, one per rollout; the rollout limit is "
                f"{limits.max_rollouts} (ADV_MAX_REQUEST_ROLLOUTS)",
                field=name,
            )
    for name, values in per_token:
        if values > limits.max_tokens:  # (one value per token: more is never right)
            raise LimitExceeded(
                f"{name} has {values} values, one per token; the token limit is "
                f"{limits.max_tokens} (ADV_MAX_REQUEST_TOKENS)",
                field=name,
            )
    _check_group_sizes(data, request, limits)
    return MessageShape(rollouts, tokens)


def _check_group_sizes(data: bytes, request: _Request, limits: RequestLimits) -> None:
    """The largest group from a view of group_index (no copy); an index out of range is the
    decoder's to name."""
    index = request.tensors.get("group_index")
    groups = len(request.group_ids) // 2
    dtype = INTEGER_DTYPES.get(index.dtype) if index is not None else None
    if index is None or dtype is None or not groups:
        return
    values = np.frombuffer(data, dtype, index.count(), index.start)
    if not values.size or int(values.min()) < 0 or int(values.max()) >= groups:
        return
    sizes = np.bincount(values, minlength=groups)
    g = int(np.argmax(sizes))
    start, stop = request.group_ids[2 * g], request.group_ids[2 * g + 1]
    limits.check_group_size(data[start:stop].decode(errors="replace"), int(sizes[g]))
