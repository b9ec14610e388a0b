"""The columns of an Arrow request (:mod:`.arrow`): checked from the stream's metadata before
pyarrow reads a batch (the Arrow pre-parser of transports/guards.py: the messages walked by
:mod:`.arrow_ipc`, the schema planned into columns, every batch's layout and the rows, tokens
and arrays it declares checked against the plan and the limits, the options in
``advantage.request`` by the JSON guard), then a validated table as the flat batch: groups
numbered by first appearance from each batch's distinct ids, the rewards, the list columns'
offsets and values (the flat batch's buffers, wrapped without a copy) and the optional prompt
keys. Errors name the column and the row (by its group and rollout where the group is known).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from advantage_contract.arrow import (
    COMPONENT_PREFIX,
    PROMPT_KEY_COLUMN,
    REQUEST_METADATA,
    REQUIRED_COLUMNS,
    TEACHER_PREFIX,
)
from advantage_contract.errors import AdvantageError
from advantage_contract.fields import (
    EXACT_INTEGER_LIMIT,
    MAX_COMPONENT_NAME_LENGTH,
    MAX_REWARD_COMPONENTS,
    REWARD_COMPONENTS_FIELD,
)
from advantage_contract.flat import (
    MAX_CONDITION_NAME_LENGTH,
    MAX_GROUP_ID_LENGTH,
    MAX_TEACHER_CONDITIONS,
    group_prompt_keys,
    prompt_ids,
)

from ..batch import TOKEN_INPUTS, RolloutBatch
from ..config import RequestLimits
from ..errors import LimitExceeded, RequestError
from ..wire.json_guard import check_body
from ..wire.json_limits import BodyLimits
from ..wire.text import check_utf8
from . import arrow_ipc


def invalid_arrow(message: str, field: str | None = None, **where: Any) -> RequestError:
    return RequestError("invalid_arrow", message, field=field, **where)


def metadata_not_json(exc: RequestError) -> RequestError:
    """``advantage.request`` refused as JSON (``exc``: the JSON decoder's or guard's words)."""
    return RequestError(
        "invalid_json",
        f"schema metadata advantage.request is not valid JSON: {exc.message}",
        field="advantage.request",
    )


def short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= 300 else text[:300] + "..."


# ---- the pre-parser -----------------------------------------------------------------------------

# What an Arrow request may declare, beyond the service's settings (docs/http.md, "Arrow"). The
# schema message carries the column names and types and the request's options (a few hundred
# bytes in practice); pyarrow turns it into objects several times its size, so it is bounded
# before pyarrow reads it.
MAX_SCHEMA_BYTES = 1024 * 1024
MAX_METADATA_KEYS = 64
# Every array of every batch (a column, a list column's values, a dictionary) costs pyarrow
# about 0.5-1 KB of objects however few values it holds, ~10x the bytes it takes in the stream:
# 32768 arrays are at most ~16 MiB.
MAX_ARRAYS = 32768


@dataclass(frozen=True)
class StreamShape:
    """What the pre-parser saw of a stream: its messages, its schema (from the schema message
    alone), and the rollouts (rows) and tokens its record batches declare."""

    layout: arrow_ipc.StreamLayout
    schema: pa.Schema
    rollouts: int
    tokens: int


def check_stream(body: bytes | bytearray | memoryview, limits: RequestLimits) -> StreamShape:
    """Refuse ``body`` (a :class:`RequestError`: 413 ``limit_exceeded`` over a limit, else 422
    naming the column where one is to blame) from its metadata, before pyarrow reads a batch:
    a stream that is malformed, cut before its end-of-stream marker or followed by other bytes
    (a truncated upload must not be computed as if it were whole), big-endian or compressed;
    columns the request does not have or of types the codec does not read; batches laid out
    otherwise than the schema says; more batches, rows, tokens or arrays than ``limits`` allow;
    options in ``advantage.request`` over the bounds a JSON request has."""
    try:
        layout = arrow_ipc.scan(
            body,
            max_messages=limits.max_arrow_batches,
            max_schema_bytes=MAX_SCHEMA_BYTES,
            max_metadata_keys=MAX_METADATA_KEYS,
        )
    except arrow_ipc.IpcLimit as exc:
        raise LimitExceeded(str(exc), field=exc.field) from exc
    except arrow_ipc.IpcError as exc:
        raise invalid_arrow(f"the body is not a valid Arrow IPC stream: {exc}") from exc
    if layout.big_endian:
        raise invalid_arrow("the stream is big-endian; send it little-endian (pyarrow's default)")
    with open_stream(body) as reader:  # (it reads the schema message only until asked for more)
        schema = reader.schema
    _check_schema_text(schema)
    rollouts, tokens = _check_layout(layout, plan_columns(schema), limits)
    options = (schema.metadata or {}).get(REQUEST_METADATA)
    if options is not None:
        try:
            check_body(options, BodyLimits(limits.max_tokens, limits.max_rollouts))
        except RequestError as exc:
            if exc.code == "invalid_json":
                raise metadata_not_json(exc) from exc
            raise
    return StreamShape(layout, schema, rollouts, tokens)


def open_stream(body: bytes | bytearray | memoryview) -> pa.ipc.RecordBatchStreamReader:
    """A reader of the stream (422 ``invalid_arrow`` when pyarrow cannot open it)."""
    try:
        # (never byte-swapped as read, whatever the schema says: big-endian is refused by
        # check_stream, and swapping reads buffers by their unvalidated offsets)
        options = pa.ipc.IpcReadOptions(ensure_native_endian=False)
        return pa.ipc.open_stream(pa.BufferReader(pa.py_buffer(body)), options=options)
    except (pa.ArrowException, OSError, ValueError, TypeError, IndexError) as exc:
        raise invalid_arrow(f"the body is not an Arrow IPC stream: {short(exc)}") from exc


def _check_schema_text(schema: pa.Schema) -> None:
    """Column names, and the schema metadata's keys and values, UTF-8 (the format's strings;
    pyarrow hands over whatever bytes the stream holds), each refused naming where it is.
    ``advantage.request`` is the request's JSON: its strings are the request's, checked and
    named by their JSON path when it is parsed (wire/text.py)."""
    for i in range(len(schema)):
        try:  # names are bytes in the stream (pyarrow decodes them when asked)
            schema.field(i).name  # noqa: B018
        except UnicodeDecodeError as exc:
            check_utf8(exc.object, f"columns[{i}]", f"the name of column {i} of the schema")
    for i, (key, value) in enumerate((schema.metadata or {}).items()):
        name = check_utf8(key, "metadata", f"key {i} of the schema metadata")
        if key != REQUEST_METADATA:
            check_utf8(value, f"metadata.{name}", f"the schema metadata value of {name!r}")


def echo(name: str) -> str:
    """A client's name as an error may repeat it: bounded, so an error stays an error."""
    return repr(name) if len(name) <= 64 else repr(name[:64]) + f"... ({len(name)} characters)"


@dataclass(frozen=True)
class _Column:
    """How a column of the schema is laid out in each record batch."""

    name: str
    kind: str  # "group_id", "reward", "list" or "null" (an optional column sent all null)
    nodes: int
    buffers: int
    dictionary: bool = False


def plan_columns(schema: pa.Schema) -> list[_Column]:
    """The request's columns, checked from the schema alone (before any batch is read): known
    names, no duplicates, the types the codec reads, teacher conditions and their names within
    the JSON limits."""
    names = schema.names
    if len(set(names)) != len(names):
        duplicate = next(n for n in names if names.count(n) > 1)
        raise invalid_arrow(f"column {echo(duplicate)} appears twice", field=duplicate[:64])
    for name in names:
        if name in REQUIRED_COLUMNS or name in TOKEN_INPUTS or name == PROMPT_KEY_COLUMN:
            continue
        if name.startswith(COMPONENT_PREFIX) and name != COMPONENT_PREFIX:
            if len(name) - len(COMPONENT_PREFIX) > MAX_COMPONENT_NAME_LENGTH:
                raise LimitExceeded(
                    f"a reward component name (column component.<name>) has "
                    f"{len(name) - len(COMPONENT_PREFIX)} characters; the limit is "
                    f"{MAX_COMPONENT_NAME_LENGTH}",
                    field=REWARD_COMPONENTS_FIELD,
                )
            continue
        if not name.startswith(TEACHER_PREFIX) or name == TEACHER_PREFIX:
            raise RequestError(
                "unknown_field",
                f"unknown column {echo(name)}; known: "
                f"{[*REQUIRED_COLUMNS, PROMPT_KEY_COLUMN, *TOKEN_INPUTS]}, teacher.<condition> "
                "and component.<name>",
                field=name[:64],
            )
        condition = name[len(TEACHER_PREFIX) :]
        if len(condition) > MAX_CONDITION_NAME_LENGTH:
            # (not echoed: it is too long to be a name)
            raise LimitExceeded(
                f"a teacher condition name (column teacher.<condition>) has {len(condition)} "
                f"characters; the limit is {MAX_CONDITION_NAME_LENGTH}",
                field="teacher_logprobs",
            )
    if sum(name.startswith(TEACHER_PREFIX) for name in names) > MAX_TEACHER_CONDITIONS:
        raise LimitExceeded(  # (the words of the other transports)
            f"the request has more than {MAX_TEACHER_CONDITIONS} teacher_logprobs conditions",
            field="teacher_logprobs",
        )
    if sum(name.startswith(COMPONENT_PREFIX) for name in names) > MAX_REWARD_COMPONENTS:
        raise LimitExceeded(
            f"the request has more than {MAX_REWARD_COMPONENTS} reward components",
            field=REWARD_COMPONENTS_FIELD,
        )
    for name in REQUIRED_COLUMNS:
        if name not in names:
            raise invalid_arrow(f"the table has no {name} column", field=name)
    return [_plan_column(field) for field in schema]


def _plan_column(field: pa.Field) -> _Column:
    name, kind = field.name, field.type
    if name == "group_id":
        dictionary = pa.types.is_dictionary(kind)
        values = kind.value_type if dictionary else kind
        if not (pa.types.is_string(values) or pa.types.is_large_string(values)):
            raise invalid_arrow(f"group_id must be utf8, got {kind}", field="group_id")
        return _Column(name, "group_id", 1, 2 if dictionary else 3, dictionary)
    if name == PROMPT_KEY_COLUMN:
        # Plain utf8 only: the layout check knows one dictionary column, group_id's.
        if pa.types.is_null(kind):
            return _Column(name, "null", 1, 0)
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise invalid_arrow(
                f"prompt_key must be a utf8 column (not dictionary-encoded), got {kind}",
                field=PROMPT_KEY_COLUMN,
            )
        return _Column(name, "prompt_key", 1, 3)
    if name == "reward" or name.startswith(COMPONENT_PREFIX):
        field = _component_field(name)
        if pa.types.is_null(kind) and name != "reward":
            return _Column(name, "null", 1, 0)
        if not (pa.types.is_floating(kind) or pa.types.is_integer(kind)):
            raise RequestError(
                "invalid_type", f"{field} must be a number column, got {kind}", field=field
            )
        return _Column(name, "reward", 1, 2)
    if pa.types.is_null(kind):
        if name == "tokens":
            raise RequestError("invalid_type", "tokens must be a list of token ids", field=name)
        return _Column(name, "null", 1, 0)
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        raise invalid_arrow(f"{name} must be a list column, got {kind}", field=name)
    value_type = kind.value_type
    integer = name == "tokens"
    if not (pa.types.is_integer(value_type) or (not integer and pa.types.is_floating(value_type))):
        want = "integers" if integer else "numbers"
        raise RequestError("invalid_type", f"{name} must hold {want}, got {value_type}", field=name)
    return _Column(name, "list", 2, 4)


def _check_layout(
    layout: arrow_ipc.StreamLayout, plan: list[_Column], limits: RequestLimits
) -> tuple[int, int]:
    """Every batch laid out as the schema says, with its buffers inside its body, uncompressed,
    and the stream's rows, tokens and arrays within the limits: all from the metadata, before
    pyarrow reads a batch. Returns (rows, tokens)."""
    nodes = sum(c.nodes for c in plan)
    buffers = sum(c.buffers for c in plan)
    tokens_node = 0
    for column in plan:
        if column.name == "tokens":
            break
        tokens_node += column.nodes
    dictionary = next((c for c in plan if c.dictionary), None)
    rows = tokens = arrays = 0
    for message in layout.messages[1:]:
        batch = message.batch
        assert batch is not None  # scan() gives every batch message its layout
        if batch.compressed:
            raise invalid_arrow(
                f"{message.name} is compressed; the service reads uncompressed streams only "
                "(write them with IpcWriteOptions(compression=None), pyarrow's default)"
            )
        if message.kind == arrow_ipc.DICTIONARY_BATCH:
            if dictionary is None:
                raise invalid_arrow(
                    f"{message.name}: no column of the schema is dictionary-encoded"
                )
            if message.is_delta:
                raise invalid_arrow(
                    f"{message.name} is a delta dictionary; write dictionaries whole "
                    "(pyarrow's default, emit_dictionary_deltas=False)",
                    field="group_id",
                )
            want_nodes, want_buffers = 1, 3
        else:
            want_nodes, want_buffers = nodes, buffers
        if (batch.node_count, batch.buffer_count, batch.variadic_counts) != (
            want_nodes,
            want_buffers,
            0,
        ):
            raise invalid_arrow(
                f"{message.name} has {batch.node_count} arrays and {batch.buffer_count} buffers "
                f"where its schema has {want_nodes} and {want_buffers}"
            )
        try:
            arrow_ipc.check_buffers(batch, message.name, message.body_end - message.body_start)
        except arrow_ipc.IpcError as exc:
            raise invalid_arrow(str(exc)) from exc
        arrays += want_nodes
        if message.kind == arrow_ipc.RECORD_BATCH:
            rows += batch.length
            tokens += max(0, batch.node(tokens_node + 1)[0])
    limits.check_rollouts(rows)
    limits.check_tokens(tokens)
    if arrays > MAX_ARRAYS:
        raise LimitExceeded(
            f"the stream has {len(layout.messages) - 1} batches of {arrays} arrays in all; the "
            f"limit is {MAX_ARRAYS} arrays: write fewer, larger batches",
            field="record_batches",
        )
    return rows, tokens


# ---- the flat batch -----------------------------------------------------------------------------


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
    """(group ids in order of first appearance, each row's group number).

    Works from each batch's distinct ids (a dictionary's entries the rows use, or a plain
    column's distinct values): never one string per row, so a dictionary of one long id
    referenced by every row costs its bytes once. Ids are checked against the JSON limit
    before they become Python strings."""
    entries: list[pa.Array] = []
    codes: list[np.ndarray] = []
    row0 = base = 0
    for chunk in table.column("group_id").chunks:
        if pa.types.is_dictionary(chunk.type):
            indices, dictionary = chunk.indices, chunk.dictionary
        else:
            encoded = pc.dictionary_encode(chunk)
            indices, dictionary = encoded.indices, encoded.dictionary
        if indices.null_count:
            row = row0 + _first(indices.is_null())
            raise RequestError("invalid_type", f"group_id of row {row} is null", field="group_id")
        index = indices.to_numpy(zero_copy_only=False).astype(np.int64)
        used, inverse = np.unique(index, return_inverse=True)
        picked = dictionary.take(pa.array(used))
        if picked.null_count:
            entry = _first(picked.is_null())
            row = row0 + int(np.flatnonzero(inverse == entry)[0])
            raise RequestError("invalid_type", f"group_id of row {row} is null", field="group_id")
        entries.append(picked)
        codes.append(inverse.reshape(-1) + base)
        base += len(picked)
        row0 += len(chunk)
    if not entries:
        return [], np.zeros(0, np.int64)
    distinct = pc.dictionary_encode(pa.concat_arrays(entries))
    row_codes = distinct.indices.to_numpy(zero_copy_only=False).astype(np.int64)[
        np.concatenate(codes)
    ]
    lengths = pc.utf8_length(distinct.dictionary).to_numpy(zero_copy_only=False)
    too_long = np.flatnonzero(lengths > MAX_GROUP_ID_LENGTH)
    if too_long.size:
        entry = int(too_long[0])
        row = int(np.flatnonzero(row_codes == entry)[0])
        # (not echoed: it is too long to be an id)
        raise LimitExceeded(
            f"group_id of row {row} has {int(lengths[entry])} characters; the limit is "
            f"{MAX_GROUP_ID_LENGTH}",
            field="group_id",
        )
    empty = np.flatnonzero(lengths == 0)
    if empty.size:  # (refused on every transport alike: streams key groups by their id)
        row = int(np.flatnonzero(row_codes == int(empty[0]))[0])
        raise RequestError(
            "invalid_value",
            f"group_id of row {row} is empty: a group id is a non-empty string",
            field="group_id",
        )
    # Number groups by first appearance.
    present, first = np.unique(row_codes, return_index=True)
    order = present[np.argsort(first)]
    rank = np.empty(len(distinct.dictionary), np.int64)
    rank[order] = np.arange(len(order))
    return distinct.dictionary.take(pa.array(order)).to_pylist(), rank[row_codes]


def _component_field(name: str) -> str:
    """The request field a number column carries: ``reward`` or ``reward_components.<name>``
    (column ``component.<name>``)."""
    if name.startswith(COMPONENT_PREFIX):
        return f"{REWARD_COMPONENTS_FIELD}.{name[len(COMPONENT_PREFIX) :]}"
    return name


def _rewards(table: pa.Table, rows: _Rows, name: str = "reward", nulls: bool = False) -> np.ndarray:
    """A number column as float64 (B,): the rewards, or a reward component's values (NaN where
    null: none; ``nulls``: a reward may be null where the request has components)."""
    field = _component_field(name)
    reward = _column(table, name)
    if pa.types.is_null(reward.type):
        return np.full(len(reward), np.nan)
    if reward.null_count and not nulls:
        row = _first(reward.is_null())
        raise RequestError("invalid_type", f"{field} is null", field=field, **rows.where(row))
    if pa.types.is_int64(reward.type) or pa.types.is_uint64(reward.type):
        values = reward.to_numpy(zero_copy_only=False)
        inexact = values > EXACT_INTEGER_LIMIT
        if pa.types.is_int64(reward.type):
            inexact |= values < -EXACT_INTEGER_LIMIT
        if inexact.any():
            row = _first(inexact)
            raise RequestError(
                "out_of_range",
                f"{field} {int(values[row])} is an integer a float64 cannot hold exactly "
                f"(beyond +-2^53); send it as a float",
                field=field,
                **rows.where(row),
            )
    values = reward.cast(pa.float64())
    if values.null_count:
        values = values.fill_null(np.nan)
    return values.to_numpy(zero_copy_only=False)


def _list_column(
    table: pa.Table, name: str, rows: _Rows, integer: bool
) -> tuple[np.ndarray, np.ndarray] | None:
    """(offsets int64 (B+1,) from 0, values (N,)) of a validated list column; None when it is
    all null (or of the null type).

    A null row (given for some rollouts, not this one) and a null value are request errors.
    The first offset need not be 0 (a slice of a longer array): only the values between the
    first and the last offset are read.
    """
    column = _column(table, name)
    if pa.types.is_null(column.type) or (column.null_count == len(column) and len(column)):
        return None
    value_type = column.type.value_type
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


def batch_from_valid(table: pa.Table, vocab_size: int | None) -> RolloutBatch:
    """:func:`.arrow.batch_from_table` of a table whose schema passed :func:`.arrow._plan` and
    whose every batch passed :func:`.arrow._validate`."""
    names = table.column_names
    group_ids, group_index = _group_column(table)
    rows = _Rows(group_ids, group_index)
    components = {
        name[len(COMPONENT_PREFIX) :]: _rewards(table, rows, name, nulls=True)
        for name in names
        if name.startswith(COMPONENT_PREFIX)
    }
    rewards = _rewards(table, rows, nulls=bool(components))

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
        prompt_ids=_prompt_ids(table, group_ids, group_index),
        reward_components=components,
        **token_inputs,
    )


def _prompt_ids(table: pa.Table, group_ids: list[str], group_index: np.ndarray) -> list[str] | None:
    """Per group, the key of its history from the optional ``prompt_key`` column (a null row
    gives none; the rows of a group must agree); None without the column."""
    if PROMPT_KEY_COLUMN not in table.column_names:
        return None
    column = _column(table, PROMPT_KEY_COLUMN)
    if pa.types.is_null(column.type):
        return None
    # (lengths from the offsets, before any key becomes a Python string)
    lengths = pc.utf8_length(column).to_numpy(zero_copy_only=False)
    too_long = np.flatnonzero(np.nan_to_num(lengths.astype(np.float64)) > MAX_GROUP_ID_LENGTH)
    if too_long.size:
        row = int(too_long[0])
        raise LimitExceeded(
            f"prompt_key of row {row} has {int(lengths[row])} characters; the limit is "
            f"{MAX_GROUP_ID_LENGTH}",
            field=PROMPT_KEY_COLUMN,
        )
    try:
        keys = group_prompt_keys(column.cast(pa.string()).to_pylist(), group_ids, group_index)
    except AdvantageError as exc:
        raise RequestError.from_contract(exc) from exc
    return prompt_ids(group_ids, keys)
