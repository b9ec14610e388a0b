"""Arrow IPC stream codec for ``POST /v1/advantages`` (ARCHITECTURE.md, "Public HTTP API").

Request: one row per rollout, ``group_id`` utf8, ``reward`` float, ``tokens`` list<int32>,
optional ``prompt_key`` utf8 (the same in every row of a group: the key of its history),
optional ``logprobs``, ``entropy``, ``sum_pi_squared``, ``is_weights``, ``returns``,
``planning_mask`` and ``teacher.<name>`` list<float32>; the rest of the JSON request in the
schema metadata key ``advantage.request``. The list columns' offsets and values buffers become
the flat batch directly: no Python loop over rollouts.

Response: one row per rollout, in request order, with ``group_id``, ``rollout_index`` (the
rollout's position within its group), ``advantages`` list<float32>, ``scalar`` float32 and each
requested per-token diagnostic as list<float32>; ``request_id``, ``namespace``, ``estimator`` and
``summary`` as JSON in the schema metadata key ``advantage.response``.

Rows of one group need not be contiguous: groups are numbered by first appearance.

The parts: this module reads a request (the stream's layout and schema checked against the
limits from its metadata, every batch validated, the options) and is the codec's entry point;
:mod:`.arrow_columns` turns a validated table into the flat batch (group numbering, rewards,
list columns, prompt keys: errors name group, rollout and column); :mod:`.arrow_response`
writes the response and holds the client side's helpers (:func:`request_table`,
:func:`read_response`). :mod:`.arrow_ipc` walks the stream's messages before pyarrow does.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from advantage_contract.arrow import (
    PROMPT_KEY_COLUMN,
    REQUEST_METADATA,
    REQUIRED_COLUMNS,
    RESPONSE_METADATA,
    TEACHER_PREFIX,
)
from advantage_contract.flat import MAX_CONDITION_NAME_LENGTH

from ..batch import TOKEN_INPUTS, RolloutBatch
from ..config import Settings
from ..errors import LimitExceeded, RequestError
from ..wire import jsonio
from ..wire.request import ComputeRequest, parse_options
from ..wire.text import check_utf8
from . import arrow_ipc
from .arrow_columns import batch_from_valid
from .arrow_response import encode_response, read_response, request_table, write_stream

# Arrow buffers are immutable, so numpy views of them are read-only, and torch warns when it
# wraps one. The batch is never written in place (estimators are pure functions), and wrapping
# without a copy is the point of this codec.
warnings.filterwarnings(
    "ignore", message="The given NumPy array is not writable", category=UserWarning
)


def _invalid(message: str, field: str | None = None, **where: Any) -> RequestError:
    return RequestError("invalid_arrow", message, field=field, **where)


# ---- request ------------------------------------------------------------------------------------

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
class ArrowLimits:
    """What one Arrow request body may hold, checked from the stream's metadata before any
    buffer is read: the service's ``ADV_MAX_REQUEST_TOKENS``, ``ADV_MAX_REQUEST_ROLLOUTS`` and
    ``ADV_MAX_ARROW_BATCHES``."""

    max_tokens: int = Settings.model_fields["max_request_tokens"].default
    max_rollouts: int = Settings.model_fields["max_request_rollouts"].default
    max_batches: int = Settings.model_fields["max_arrow_batches"].default

    @classmethod
    def from_settings(cls, settings: Settings) -> ArrowLimits:
        return cls(
            max_tokens=settings.max_request_tokens,
            max_rollouts=settings.max_request_rollouts,
            max_batches=settings.max_arrow_batches,
        )


def _echo(name: str) -> str:
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


def _plan(schema: pa.Schema) -> list[_Column]:
    """The request's columns, checked from the schema alone (before any batch is read): known
    names, no duplicates, the types the codec reads, teacher condition names within the JSON
    limit."""
    names = schema.names
    if len(set(names)) != len(names):
        duplicate = next(n for n in names if names.count(n) > 1)
        raise _invalid(f"column {_echo(duplicate)} appears twice", field=duplicate[:64])
    for name in names:
        if name in REQUIRED_COLUMNS or name in TOKEN_INPUTS or name == PROMPT_KEY_COLUMN:
            continue
        if not name.startswith(TEACHER_PREFIX) or name == TEACHER_PREFIX:
            raise RequestError(
                "unknown_field",
                f"unknown column {_echo(name)}; known: "
                f"{[*REQUIRED_COLUMNS, PROMPT_KEY_COLUMN, *TOKEN_INPUTS]} and teacher.<condition>",
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
    for name in REQUIRED_COLUMNS:
        if name not in names:
            raise _invalid(f"the table has no {name} column", field=name)
    return [_plan_column(field) for field in schema]


def _plan_column(field: pa.Field) -> _Column:
    name, kind = field.name, field.type
    if name == "group_id":
        dictionary = pa.types.is_dictionary(kind)
        values = kind.value_type if dictionary else kind
        if not (pa.types.is_string(values) or pa.types.is_large_string(values)):
            raise _invalid(f"group_id must be utf8, got {kind}", field="group_id")
        return _Column(name, "group_id", 1, 2 if dictionary else 3, dictionary)
    if name == PROMPT_KEY_COLUMN:
        # Plain utf8 only: the layout check knows one dictionary column, group_id's.
        if pa.types.is_null(kind):
            return _Column(name, "null", 1, 0)
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise _invalid(
                f"prompt_key must be a utf8 column (not dictionary-encoded), got {kind}",
                field=PROMPT_KEY_COLUMN,
            )
        return _Column(name, "prompt_key", 1, 3)
    if name == "reward":
        if not (pa.types.is_floating(kind) or pa.types.is_integer(kind)):
            raise RequestError(
                "invalid_type", f"reward must be a number column, got {kind}", field="reward"
            )
        return _Column(name, "reward", 1, 2)
    if pa.types.is_null(kind):
        if name == "tokens":
            raise RequestError("invalid_type", "tokens must be a list of token ids", field=name)
        return _Column(name, "null", 1, 0)
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        raise _invalid(f"{name} must be a list column, got {kind}", field=name)
    value_type = kind.value_type
    integer = name == "tokens"
    if not (pa.types.is_integer(value_type) or (not integer and pa.types.is_floating(value_type))):
        want = "integers" if integer else "numbers"
        raise RequestError("invalid_type", f"{name} must hold {want}, got {value_type}", field=name)
    return _Column(name, "list", 2, 4)


def _check_layout(layout: arrow_ipc.StreamLayout, plan: list[_Column], limits: ArrowLimits) -> None:
    """Every batch laid out as the schema says, with its buffers inside its body, uncompressed,
    and the stream's rows, tokens and arrays within the limits: all from the metadata, before
    pyarrow reads a batch."""
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
            raise _invalid(
                f"{message.name} is compressed; the service reads uncompressed streams only "
                "(write them with IpcWriteOptions(compression=None), pyarrow's default)"
            )
        if message.kind == arrow_ipc.DICTIONARY_BATCH:
            if dictionary is None:
                raise _invalid(f"{message.name}: no column of the schema is dictionary-encoded")
            if message.is_delta:
                raise _invalid(
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
            raise _invalid(
                f"{message.name} has {batch.node_count} arrays and {batch.buffer_count} buffers "
                f"where its schema has {want_nodes} and {want_buffers}"
            )
        try:
            arrow_ipc.check_buffers(batch, message.name, message.body_end - message.body_start)
        except arrow_ipc.IpcError as exc:
            raise _invalid(str(exc)) from exc
        arrays += want_nodes
        if message.kind == arrow_ipc.RECORD_BATCH:
            rows += batch.length
            tokens += max(0, batch.node(tokens_node + 1)[0])
    if rows > limits.max_rollouts:
        raise LimitExceeded(
            f"the request has {rows} rollouts; the limit is {limits.max_rollouts} "
            "(ADV_MAX_REQUEST_ROLLOUTS): split the batch",
            field="rollouts",
        )
    if tokens > limits.max_tokens:
        raise LimitExceeded(
            f"the request has {tokens} tokens; the limit is {limits.max_tokens} "
            "(ADV_MAX_REQUEST_TOKENS): split the batch",
            field="tokens",
        )
    if arrays > MAX_ARRAYS:
        raise LimitExceeded(
            f"the stream has {len(layout.messages) - 1} batches of {arrays} arrays in all; the "
            f"limit is {MAX_ARRAYS} arrays: write fewer, larger batches",
            field="record_batches",
        )


def read_table(body: bytes | bytearray | memoryview, limits: ArrowLimits | None = None) -> pa.Table:
    """The IPC stream as one table, every batch laid out as its schema says and within
    ``limits`` (checked from the messages' metadata before pyarrow reads a batch), then every
    column validated in full (offsets, UTF-8, dictionary indices and the dictionaries
    themselves) before any value is read. Anything unreadable or invalid is a 422
    ``invalid_arrow`` naming the column where one is to blame, and so is a stream cut before
    its end-of-stream marker or followed by other bytes (a truncated upload must not be
    computed as if it were whole); a stream over a limit is a 413 ``limit_exceeded``."""
    limits = limits or ArrowLimits()
    try:
        layout = arrow_ipc.scan(
            body,
            max_messages=limits.max_batches,
            max_schema_bytes=MAX_SCHEMA_BYTES,
            max_metadata_keys=MAX_METADATA_KEYS,
        )
    except arrow_ipc.IpcLimit as exc:
        raise LimitExceeded(str(exc), field=exc.field) from exc
    except arrow_ipc.IpcError as exc:
        raise _invalid(f"the body is not a valid Arrow IPC stream: {exc}") from exc
    if layout.big_endian:
        raise _invalid("the stream is big-endian; send it little-endian (pyarrow's default)")
    try:
        # (never byte-swapped as read, whatever the schema says: big-endian is refused above,
        # and swapping reads buffers by their unvalidated offsets)
        options = pa.ipc.IpcReadOptions(ensure_native_endian=False)
        reader = pa.ipc.open_stream(pa.BufferReader(pa.py_buffer(body)), options=options)
    except (pa.ArrowException, OSError, ValueError, TypeError, IndexError) as exc:
        raise _invalid(f"the body is not an Arrow IPC stream: {_short(exc)}") from exc
    with reader:
        _check_schema_text(reader.schema)
        plan = _plan(reader.schema)
        _check_layout(layout, plan, limits)
        batches: list[pa.RecordBatch] = []
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                break
            except (pa.ArrowException, OSError, ValueError, TypeError, IndexError) as exc:
                raise _invalid(f"the body is not an Arrow IPC stream: {_short(exc)}") from exc
            _validate(batch, len(batches))
            batches.append(batch)
        return pa.Table.from_batches(batches, reader.schema)


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


def _short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= 300 else text[:300] + "..."


def _validate(batch: pa.RecordBatch, index: int) -> None:
    """Every column of ``batch`` validated in full (a dictionary column's dictionary too)
    before any of its values is read: offsets in order and inside their data, UTF-8, indices
    inside their dictionary, child arrays as long as their offsets say."""
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        try:
            column.validate(full=True)
        except pa.ArrowException as exc:
            raise _invalid(
                f"column {_echo(name)} of record batch {index} is not valid Arrow: {_short(exc)}",
                field=name[:64],
            ) from exc
    try:
        batch.validate()  # every column as long as the batch
    except pa.ArrowException as exc:
        raise _invalid(f"record batch {index} is not valid Arrow: {_short(exc)}") from exc


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


def decode_request(
    body: bytes | bytearray | memoryview, limits: ArrowLimits | None = None
) -> ComputeRequest:
    """An Arrow IPC request body as a validated :class:`ComputeRequest` (see
    :func:`read_table` for what is checked before any value is read)."""
    table = read_table(body, limits)
    metadata = request_options(table.schema)
    options = parse_options(metadata)
    if metadata.get("groups") is not None:
        raise RequestError(
            "unknown_field",
            "with Arrow the rollouts are the table's rows; advantage.request may not "
            "contain groups",
            field="groups",
        )
    return options.with_batch(batch_from_valid(table, options.vocab_size))


def batch_from_table(table: pa.Table, vocab_size: int | None = None) -> RolloutBatch:
    """The request table as a validated flat batch (errors name group, rollout and column);
    the table is validated in full first, as a decoded stream is."""
    _plan(table.schema)
    for index, batch in enumerate(table.to_batches()):
        _validate(batch, index)
    return batch_from_valid(table, vocab_size)


__all__ = [
    "MAX_ARRAYS",
    "MAX_METADATA_KEYS",
    "MAX_SCHEMA_BYTES",
    "RESPONSE_METADATA",
    "ArrowLimits",
    "batch_from_table",
    "decode_request",
    "encode_response",
    "read_response",
    "read_table",
    "request_options",
    "request_table",
    "write_stream",
]
