"""Arrow IPC stream codec for ``POST /v1/advantages`` (ARCHITECTURE.md, "Public HTTP API").

Request: one row per rollout, ``group_id`` utf8, ``reward`` float, ``tokens`` list<int32>,
optional ``logprobs``, ``entropy``, ``sum_pi_squared``, ``is_weights``, ``planning_mask`` and
``teacher.<name>`` list<float32>; the rest of the JSON request in the schema metadata key
``advantage.request``. The list columns' offsets and values buffers become the flat batch
directly: no Python loop over rollouts.

Response: one row per rollout, in request order, with ``group_id``, ``rollout_index`` (the
rollout's position within its group), ``advantages`` list<float32>, ``scalar`` float32 and each
requested per-token diagnostic as list<float32>; ``request_id``, ``namespace``, ``estimator`` and
``summary`` as JSON in the schema metadata key ``advantage.response``.

Rows of one group need not be contiguous: groups are numbered by first appearance.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..batch import TOKEN_INPUTS, RolloutBatch
from ..errors import RequestError
from ..estimators import AdvantageResult
from ..wire import jsonio
from ..wire.request import ComputeRequest, parse_options

MEDIA_TYPE = "application/vnd.apache.arrow.stream"
REQUEST_METADATA = b"advantage.request"
RESPONSE_METADATA = b"advantage.response"
TEACHER_PREFIX = "teacher."
REQUIRED_COLUMNS = ("group_id", "reward", "tokens")

# Arrow buffers are immutable, so numpy views of them are read-only, and torch warns when it
# wraps one. The batch is never written in place (estimators are pure functions), and wrapping
# without a copy is the point of this codec.
warnings.filterwarnings(
    "ignore", message="The given NumPy array is not writable", category=UserWarning
)


def _invalid(message: str, field: str | None = None, **where: Any) -> RequestError:
    return RequestError("invalid_arrow", message, field=field, **where)


# ---- request ------------------------------------------------------------------------------------


# The IPC stream's end-of-stream marker: continuation 0xFFFFFFFF, then a zero length.
END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def read_table(body: bytes | bytearray | memoryview) -> pa.Table:
    """The IPC stream as one table; anything unreadable is a 422 ``invalid_arrow``, and so is a
    stream cut before its end-of-stream marker or followed by other bytes (a truncated upload
    must not be computed as if it were whole)."""
    source = pa.BufferReader(pa.py_buffer(body))
    try:
        with pa.ipc.open_stream(source) as reader:
            table = reader.read_all()
    except (pa.ArrowException, OSError, ValueError, TypeError, IndexError) as exc:
        raise _invalid(f"the body is not an Arrow IPC stream: {exc}") from exc
    end = source.tell()
    if bytes(memoryview(body)[max(0, end - len(END_OF_STREAM)) : end]) != END_OF_STREAM:
        raise _invalid(
            "the Arrow IPC stream ends without its end-of-stream marker: the body is cut short"
        )
    if end != len(body):
        raise _invalid(
            f"the body has {len(body) - end} bytes after the Arrow IPC stream's end-of-stream "
            "marker"
        )
    return table


def request_options(schema: pa.Schema) -> dict[str, Any]:
    """The JSON object in the ``advantage.request`` metadata key ({} when absent)."""
    raw = (schema.metadata or {}).get(REQUEST_METADATA)
    if raw is None:
        return {}
    try:
        options = jsonio.loads(raw)
    except RequestError as exc:
        raise RequestError(
            "invalid_json",
            f"schema metadata advantage.request is not valid JSON: {exc.message}",
            field="advantage.request",
        ) from exc
    if not isinstance(options, dict):
        raise RequestError(
            "invalid_type",
            "schema metadata advantage.request must be a JSON object",
            field="advantage.request",
        )
    return options


def decode_request(body: bytes | bytearray | memoryview) -> ComputeRequest:
    """An Arrow IPC request body as a validated :class:`ComputeRequest`."""
    table = read_table(body)
    metadata = request_options(table.schema)
    options = parse_options(metadata)
    if metadata.get("groups") is not None:
        raise RequestError(
            "unknown_field",
            "with Arrow the rollouts are the table's rows; advantage.request may not "
            "contain groups",
            field="groups",
        )
    return options.with_batch(batch_from_table(table, options.vocab_size))


class _Rows:
    """Locates a row for error messages: its group id and its index within the group."""

    def __init__(self, group_ids: list[str], group_index: np.ndarray) -> None:
        self.group_ids = group_ids
        self.group_index = group_index

    def where(self, row: int) -> dict[str, Any]:
        g = int(self.group_index[row])
        rank = int(np.count_nonzero(self.group_index[:row] == g))
        return {"group_id": self.group_ids[g], "rollout_index": rank}


def _column(table: pa.Table, name: str) -> pa.Array:
    column = table.column(name)
    if column.num_chunks == 1:
        return column.chunk(0)
    return column.combine_chunks()


def _first(mask: pa.Array | np.ndarray) -> int:
    values = mask.to_numpy(zero_copy_only=False) if isinstance(mask, pa.Array) else mask
    return int(np.flatnonzero(values)[0])


def _group_column(table: pa.Table) -> tuple[list[str], np.ndarray]:
    column = _column(table, "group_id")
    kind = column.type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise _invalid(f"group_id must be utf8, got {column.type}", field="group_id")
    if column.null_count:
        row = _first(column.is_null())
        raise RequestError("invalid_type", f"group_id of row {row} is null", field="group_id")
    # dictionary_encode numbers distinct values in order of first appearance.
    encoded = pc.dictionary_encode(column.cast(pa.string()))
    group_ids = encoded.dictionary.to_pylist()
    group_index = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    return group_ids, group_index


def _list_column(
    table: pa.Table, name: str, rows: _Rows, integer: bool
) -> tuple[np.ndarray, np.ndarray] | None:
    """(offsets int64 (B+1,) from 0, values (N,)) of a list column; None when every row is null.

    A null row (given for some rollouts, not this one) and a null value are request errors.
    """
    column = _column(table, name)
    if column.null_count == len(column) and len(column):
        return None
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
        raise _invalid(f"{name} must be a list column, got {column.type}", field=name)
    value_type = column.type.value_type
    numeric = pa.types.is_integer(value_type) or (not integer and pa.types.is_floating(value_type))
    if not numeric:
        want = "integers" if integer else "numbers"
        raise RequestError("invalid_type", f"{name} must hold {want}, got {value_type}", field=name)
    if column.null_count:
        row = _first(column.is_null())
        raise RequestError(
            "missing_input",
            f"{name} is given for some rollouts but not this one; give it for every rollout "
            "or none",
            field=name,
            **rows.where(row),
        )
    offsets = column.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    start, end = int(offsets[0]), int(offsets[-1])
    values = column.values.slice(start, end - start)
    offsets -= start
    if values.null_count:
        position = _first(values.is_null())
        row = int(np.searchsorted(offsets, position, side="right")) - 1
        raise RequestError(
            "invalid_type",
            f"{name}[{position - int(offsets[row])}] is null",
            field=name,
            **rows.where(row),
        )
    if integer and not (pa.types.is_int32(value_type) or pa.types.is_int64(value_type)):
        try:
            values = values.cast(pa.int64())
        except pa.ArrowInvalid as exc:
            raise RequestError(
                "token_out_of_range", f"{name} holds an id out of range: {exc}", field=name
            ) from exc
    if pa.types.is_float16(value_type):
        values = values.cast(pa.float32())
    return offsets, values.to_numpy(zero_copy_only=False)


def batch_from_table(table: pa.Table, vocab_size: int | None = None) -> RolloutBatch:
    """The request table as a validated flat batch (errors name group, rollout and column)."""
    names = table.column_names
    if len(set(names)) != len(names):
        duplicate = next(n for n in names if names.count(n) > 1)
        raise _invalid(f"column {duplicate!r} appears twice", field=duplicate)
    for name in names:
        if name in REQUIRED_COLUMNS or name in TOKEN_INPUTS:
            continue
        if not name.startswith(TEACHER_PREFIX) or name == TEACHER_PREFIX:
            raise RequestError(
                "unknown_field",
                f"unknown column {name!r}; known: {[*REQUIRED_COLUMNS, *TOKEN_INPUTS]} and "
                "teacher.<condition>",
                field=name,
            )
    for name in REQUIRED_COLUMNS:
        if name not in names:
            raise _invalid(f"the table has no {name} column", field=name)

    group_ids, group_index = _group_column(table)
    rows = _Rows(group_ids, group_index)

    reward = _column(table, "reward")
    if not (pa.types.is_floating(reward.type) or pa.types.is_integer(reward.type)):
        raise RequestError(
            "invalid_type", f"reward must be a number column, got {reward.type}", field="reward"
        )
    if reward.null_count:
        row = _first(reward.is_null())
        raise RequestError("invalid_type", "reward is null", field="reward", **rows.where(row))
    rewards = reward.cast(pa.float64()).to_numpy(zero_copy_only=False)

    tokens = _list_column(table, "tokens", rows, integer=True)
    if tokens is None:
        row = 0
        raise RequestError(
            "invalid_type", "tokens must be a list of token ids", field="tokens", **rows.where(row)
        )
    offsets, token_values = tokens
    lengths = np.diff(offsets)

    def per_token(name: str, field: str) -> np.ndarray | None:
        out = _list_column(table, name, rows, integer=False)
        if out is None:
            return None
        their_offsets, values = out
        mismatch = np.flatnonzero(np.diff(their_offsets) != lengths)
        if mismatch.size:
            row = int(mismatch[0])
            raise RequestError(
                "length_mismatch",
                f"{field} has {int(their_offsets[row + 1] - their_offsets[row])} values for "
                f"{int(lengths[row])} tokens",
                field=field,
                **rows.where(row),
            )
        return values

    token_inputs = {name: per_token(name, name) for name in TOKEN_INPUTS if name in names}
    teacher: dict[str, np.ndarray] = {}
    for name in names:
        if name.startswith(TEACHER_PREFIX):
            condition = name[len(TEACHER_PREFIX) :]
            values = per_token(name, f"teacher_logprobs.{condition}")
            if values is not None:
                teacher[condition] = values
    return RolloutBatch.from_flat(
        tokens=token_values,
        offsets=offsets,
        group_ids=group_ids,
        group_index=group_index,
        rewards=rewards,
        teacher_logprobs=teacher,
        vocab_size=vocab_size,
        **token_inputs,
    )


# ---- response -----------------------------------------------------------------------------------


def _lists(offsets: pa.Array, values: np.ndarray) -> pa.Array:
    return pa.ListArray.from_arrays(offsets, pa.array(values, type=pa.float32()))


def encode_response(
    req: ComputeRequest, result: AdvantageResult, summary: dict[str, Any]
) -> pa.Buffer:
    """The response as an Arrow IPC stream (one record batch)."""
    batch = req.batch
    offsets = pa.array(batch.offsets.cpu().numpy().astype(np.int32), type=pa.int32())
    group_index = batch.group_index.cpu().numpy()
    columns: dict[str, pa.Array] = {
        "group_id": pa.array(batch.group_ids, type=pa.string()).take(pa.array(group_index)),
        "rollout_index": pa.array(batch.rank_in_group.cpu().numpy().astype(np.int32)),
        "advantages": _lists(offsets, result.advantages.cpu().numpy()),
        "scalar": pa.array(result.scalars.cpu().numpy(), type=pa.float32()),
    }
    for name in req.returns:
        if name != "scalar":
            columns[name] = _lists(offsets, result.diagnostics[name].cpu().numpy())
    meta = {
        "request_id": req.request_id,
        "namespace": req.namespace,
        "estimator": req.estimator.to_dict(),
        "summary": summary,
    }
    table = pa.table(columns).replace_schema_metadata({RESPONSE_METADATA: jsonio.dumps(meta)})
    return write_stream(table)


def write_stream(table: pa.Table) -> pa.Buffer:
    """``table`` as an Arrow IPC stream."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


# ---- client side (tests, benchmarks, embedding trainers) ---------------------------------------


def request_table(batch: RolloutBatch, options: Mapping[str, Any] | None = None) -> pa.Table:
    """A flat batch as a request table (the inverse of :func:`batch_from_table`), with
    ``options`` (the JSON request without ``groups``) in the schema metadata."""
    offsets = pa.array(batch.offsets.cpu().numpy().astype(np.int32), type=pa.int32())
    group_index = batch.group_index.cpu().numpy()
    columns: dict[str, pa.Array] = {
        "group_id": pa.array(batch.group_ids, type=pa.string()).take(pa.array(group_index)),
        "reward": pa.array(batch.rewards.cpu().numpy(), type=pa.float32()),
        "tokens": pa.ListArray.from_arrays(
            offsets, pa.array(batch.tokens.cpu().numpy().astype(np.int32), type=pa.int32())
        ),
    }
    for name, values in batch.token_inputs().items():
        columns[name] = _lists(offsets, values.cpu().numpy())
    for name, values in batch.teacher_logprobs.items():
        columns[TEACHER_PREFIX + name] = _lists(offsets, values.cpu().numpy())
    table = pa.table(columns)
    if options:
        table = table.replace_schema_metadata({REQUEST_METADATA: jsonio.dumps(dict(options))})
    return table


def read_response(body: bytes | bytearray | memoryview) -> tuple[dict[str, Any], pa.Table]:
    """(the ``advantage.response`` metadata object, the per-rollout table) of a response."""
    with pa.ipc.open_stream(pa.py_buffer(body)) as reader:
        table = reader.read_all()
    meta = jsonio.loads((table.schema.metadata or {})[RESPONSE_METADATA])
    return meta, table
