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

The parts: this module reads a request (the stream pre-parsed through transports/guards.py, every
batch validated, the options) and is the codec's entry point; :mod:`.arrow_columns` is the
pre-parser (the schema planned into columns, each batch's layout and counts checked against
them and the limits) and turns a validated table into the flat batch (group numbering, rewards,
list columns, prompt keys: errors name group, rollout and column); :mod:`.arrow_response`
writes the response and holds the client side's helpers (:func:`request_table`,
:func:`read_response`). :mod:`.arrow_ipc` walks the stream's messages before pyarrow does.
"""

from __future__ import annotations

import warnings
from typing import Any

import pyarrow as pa
from advantage_contract.arrow import REQUEST_METADATA, RESPONSE_METADATA

from ..batch import RolloutBatch
from ..config import RequestLimits
from ..errors import RequestError
from ..wire import jsonio
from ..wire.request import ComputeRequest, parse_options
from .arrow_columns import (
    MAX_ARRAYS,
    MAX_METADATA_KEYS,
    MAX_SCHEMA_BYTES,
    batch_from_valid,
    echo,
    invalid_arrow,
    metadata_not_json,
    open_stream,
    plan_columns,
    short,
)
from .arrow_response import encode_response, read_response, request_table, write_stream
from .guards import PRE_PARSERS

# Arrow buffers are immutable, so numpy views of them are read-only, and torch warns when it
# wraps one. The batch is never written in place (estimators are pure functions), and wrapping
# without a copy is the point of this codec.
warnings.filterwarnings(
    "ignore", message="The given NumPy array is not writable", category=UserWarning
)


# The name the transports knew the Arrow limits by: every transport's now (transports/guards.py).
ArrowLimits = RequestLimits


def read_table(
    body: bytes | bytearray | memoryview, limits: RequestLimits | None = None
) -> pa.Table:
    """The IPC stream as one table: checked from its metadata by the Arrow pre-parser
    (:func:`.arrow_columns.check_stream`, through transports/guards.py) against ``limits`` before
    pyarrow reads a batch, then every column validated in full (offsets, UTF-8, dictionary
    indices and the dictionaries themselves) before any value is read. Anything unreadable or
    invalid is a 422 ``invalid_arrow`` naming the column where one is to blame; a stream over
    a limit is a 413 ``limit_exceeded``."""
    PRE_PARSERS["arrow"](body, limits or RequestLimits())
    with open_stream(body) as reader:
        batches: list[pa.RecordBatch] = []
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                break
            except (pa.ArrowException, OSError, ValueError, TypeError, IndexError) as exc:
                raise invalid_arrow(f"the body is not an Arrow IPC stream: {short(exc)}") from exc
            _validate(batch, len(batches))
            batches.append(batch)
        return pa.Table.from_batches(batches, reader.schema)


def _validate(batch: pa.RecordBatch, index: int) -> None:
    """Every column of ``batch`` validated in full (a dictionary column's dictionary too)
    before any of its values is read: offsets in order and inside their data, UTF-8, indices
    inside their dictionary, child arrays as long as their offsets say."""
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        try:
            column.validate(full=True)
        except pa.ArrowException as exc:
            raise invalid_arrow(
                f"column {echo(name)} of record batch {index} is not valid Arrow: {short(exc)}",
                field=name[:64],
            ) from exc
    try:
        batch.validate()  # every column as long as the batch
    except pa.ArrowException as exc:
        raise invalid_arrow(f"record batch {index} is not valid Arrow: {short(exc)}") from exc


def request_options(schema: pa.Schema) -> dict[str, Any]:
    """The JSON object in the ``advantage.request`` metadata key ({} when absent)."""
    raw = (schema.metadata or {}).get(REQUEST_METADATA)
    if raw is None:
        return {}
    try:
        options = jsonio.loads(raw)
    except RequestError as exc:
        raise metadata_not_json(exc) from exc
    if not isinstance(options, dict):
        raise RequestError(
            "invalid_type",
            "schema metadata advantage.request must be a JSON object",
            field="advantage.request",
        )
    return options


def decode_request(
    body: bytes | bytearray | memoryview, limits: RequestLimits | None = None
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
    plan_columns(table.schema)
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
