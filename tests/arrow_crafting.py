"""Arrow request bodies crafted byte by byte: valid streams written by pyarrow, then their
buffers and metadata rewritten where the stream stores them (pyarrow's writers refuse to write
invalid arrays, an attacker's bytes do not).

Positions come from ``advantage_service.transports.arrow_ipc.scan`` with its bounds opened
wide, which only locates things: the checks under test are the codec's.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pyarrow as pa
from advantage_service.transports import arrow_ipc

OPEN = {"max_messages": 10**9, "max_schema_bytes": 2**62, "max_metadata_keys": 2**62}
OPTIONS = {"estimator": "grpo", "return": ["scalar"]}


def layout(body: bytes | bytearray) -> arrow_ipc.StreamLayout:
    return arrow_ipc.scan(body, **OPEN)


def stream(
    table: pa.Table | pa.RecordBatch,
    *,
    batches: list[pa.RecordBatch] | None = None,
    **write_options: Any,
) -> bytes:
    """``table`` (or ``batches`` of its schema) as an IPC stream."""
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(**write_options)
    with pa.ipc.new_stream(sink, table.schema, options=options) as writer:
        if batches is None:
            writer.write(table)
        else:
            for batch in batches:
                writer.write_batch(batch)
    return bytes(sink.getvalue().to_pybytes())


def request_table(
    group_ids: pa.Array | None = None,
    rewards: pa.Array | None = None,
    options: dict[str, Any] | None = None,
    **extra: pa.Array,
) -> pa.Table:
    """Two groups of two rollouts, tokens and log-probs, the options in the metadata."""
    columns = {
        "group_id": group_ids if group_ids is not None else pa.array(["ga", "gb", "ga", "gb"]),
        "reward": rewards if rewards is not None else pa.array([1.0, 0.0, 0.0, 1.0]),
        "tokens": pa.array([[1, 2], [3], [4, 5, 6], [7]], pa.list_(pa.int32())),
        "logprobs": pa.array(
            [[-0.5, -1.0], [-0.25], [-1.5, -0.5, -0.75], [-2.0]], pa.list_(pa.float32())
        ),
        **extra,
    }
    meta = {"advantage.request": json.dumps(options if options is not None else OPTIONS)}
    return pa.table(columns).replace_schema_metadata(meta)


def buffer_span(body: bytes | bytearray, message: int, buffer: int) -> tuple[int, int]:
    """(start, end) in the stream of buffer ``buffer`` of message ``message``."""
    found = layout(body).messages[message]
    assert found.batch is not None
    offset, length = found.batch.buffer(buffer)
    return found.body_start + offset, found.body_start + offset + length


def with_ints(body: bytes, message: int, buffer: int, values: list[int], fmt: str = "<i") -> bytes:
    """``body`` with the first values of a buffer replaced."""
    out = bytearray(body)
    start, end = buffer_span(out, message, buffer)
    size = struct.calcsize(fmt)
    assert start + size * len(values) <= end, "the buffer is too short for these values"
    for k, value in enumerate(values):
        struct.pack_into(fmt, out, start + size * k, value)
    return bytes(out)


def with_bytes(body: bytes, message: int, buffer: int, data: bytes) -> bytes:
    out = bytearray(body)
    start, end = buffer_span(out, message, buffer)
    assert start + len(data) <= end
    out[start : start + len(data)] = data
    return bytes(out)


# ---- the attacks reported, as bodies ------------------------------------------------------------

# Buffers of a record batch of request_table(): group_id validity, offsets, data; reward
# validity, data; tokens validity, offsets, values validity, values; logprobs the same.
GROUP_OFFSETS, TOKENS_OFFSETS, LOGPROBS_OFFSETS = 1, 6, 10


def group_offsets(values: list[int]) -> bytes:
    """The group_id column (4 rows: 5 offsets) with these offsets."""
    return with_ints(stream(request_table()), 1, GROUP_OFFSETS, values)


# The plain group_id column's data is "gagbgagb" (offsets 0, 2, 4, 6, 8).
NEGATIVE_OFFSETS = [0, -4096, 4, 6, 8]
DECREASING_OFFSETS = [0, 6, 2, 6, 8]
OFFSETS_PAST_THE_END = [0, 2, 4, 6, 8 + 2**20]


def dictionary_request(indices: list[int] | None = None, index_type: Any = None) -> bytes:
    """group_id dictionary-encoded: dictionary ["ga", "gb"], indices 0 1 0 1."""
    kind = index_type if index_type is not None else pa.int32()
    ids = pa.DictionaryArray.from_arrays(
        pa.array(indices or [0, 1, 0, 1], kind), pa.array(["ga", "gb"])
    )
    return stream(request_table(ids))


def dictionary_entry_past_the_end(distance: int) -> bytes:
    """The dictionary's last entry ends ``distance`` bytes past the end of its data (message
    1 is the dictionary batch: validity, offsets, data)."""
    return with_ints(dictionary_request(), 1, 1, [0, 2, 4 + distance])


def dictionary_indices(values: list[int]) -> bytes:
    """The dictionary-encoded group_id with these indices (message 2 is the record batch)."""
    return with_ints(dictionary_request(), 2, 1, values)


def invalid_utf8(dictionary: bool) -> bytes:
    """A group id holding the bytes 0xff 0xfe (never UTF-8)."""
    if dictionary:
        return with_bytes(dictionary_request(), 1, 2, b"\xff\xfe")
    return with_bytes(stream(request_table()), 1, GROUP_OFFSETS + 1, b"\xff\xfe")


def integer_reward(value: int, kind: pa.DataType) -> bytes:
    """Row 1 (group gb, its rollout 0) has reward ``value``."""
    return stream(request_table(rewards=pa.array([1, value, 0, 1], kind)))


def list_offsets_from(start: int) -> tuple[bytes, pa.Table]:
    """tokens and logprobs whose offsets start at ``start`` (as a writer that sends a slice of
    longer arrays does: the first ``start`` values belong to no row), and the table the body
    means. Written with ``start`` junk values in front of row 0's lists, whose first offset is
    then rewritten from 0 to ``start``."""
    table = request_table()
    junk_tokens = pa.array([[99_999] * start + [1, 2], [3], [4, 5, 6], [7]], pa.list_(pa.int32()))
    first = [7.0] * start + [-0.5, -1.0]
    junk_logprobs = pa.array([first, [-0.25], [-1.5, -0.5, -0.75], [-2.0]], pa.list_(pa.float32()))
    written = table.set_column(2, "tokens", junk_tokens).set_column(3, "logprobs", junk_logprobs)
    body = stream(written)
    for buffer in (TOKENS_OFFSETS, LOGPROBS_OFFSETS):
        body = with_ints(body, 1, buffer, [start])
    return body, table


def several_batches(count: int = 3) -> tuple[bytes, pa.Table]:
    """request_table() split into ``count`` record batches (one row each, the rest in the last)."""
    table = request_table()
    rows = table.num_rows
    cuts = [min(i, rows) for i in range(count)] + [rows]
    batches = [
        table.slice(cuts[i], cuts[i + 1] - cuts[i]).to_batches()[0]
        if cuts[i + 1] > cuts[i]
        else pa.RecordBatch.from_pylist([], schema=table.schema)
        for i in range(count)
    ]
    return stream(table, batches=batches), table


def compressed_tokens(tokens: int, codec: str) -> bytes:
    """One rollout of ``tokens`` zero token ids (and its group's second rollout of one), the
    buffers compressed with ``codec``: a few KB declaring ``4 * tokens`` bytes of token ids."""
    values = pa.array(np.zeros(tokens, np.int32))
    column = pa.ListArray.from_arrays(
        pa.array([0, tokens, tokens + 1], pa.int32()),
        pa.concat_arrays([values, pa.array([1], pa.int32())]),
    )
    table = pa.table(
        {"group_id": pa.array(["g", "g"]), "reward": pa.array([1.0, 0.0]), "tokens": column}
    ).replace_schema_metadata({"advantage.request": json.dumps(OPTIONS)})
    return stream(table, compression=codec)


def many_batches(count: int, table: pa.Table | None = None) -> bytes:
    """``count`` one-row record batches (of ``table``, else request_table()): the first one's
    message repeated (a few hundred bytes each), without building ``count`` batches here."""
    table = (table if table is not None else request_table()).slice(0, 1)
    one = stream(table)
    found = layout(one)
    schema, batch = found.messages[0], found.messages[1]
    head = one[: batch.start]
    message = one[batch.start : batch.body_end]
    assert schema.start == 0
    return head + message * count + struct.pack("<Ii", arrow_ipc.CONTINUATION, 0)


def big_metadata_value(size: int) -> bytes:
    """An ``advantage.request`` of ``size`` bytes (valid JSON: spaces after the object)."""
    options = json.dumps(OPTIONS) + " " * max(0, size - len(json.dumps(OPTIONS)))
    table = request_table().replace_schema_metadata({"advantage.request": options})
    return stream(table)


def many_metadata_keys(count: int) -> bytes:
    metadata = {f"k{i}": "" for i in range(count)}
    metadata["advantage.request"] = json.dumps(OPTIONS)
    return stream(request_table().replace_schema_metadata(metadata))


def long_group_id(length: int, dictionary: bool = False) -> bytes:
    ids = pa.array(["g" * length, "gb", "g" * length, "gb"])
    return stream(request_table(ids.dictionary_encode() if dictionary else ids))


def long_teacher_name(length: int) -> bytes:
    values = request_table().column("logprobs")
    return stream(request_table(**{"teacher." + "t" * length: values}))


def big_endian() -> bytes:
    """request_table() with its schema declaring big-endian buffers. Writers leave the
    endianness field out (little-endian is its default), so the schema table's vtable entry
    for it is pointed at a u16 holding 1 further on: the element count of the (one-entry)
    custom_metadata vector, with the table's declared size grown to reach it."""
    body = bytearray(stream(request_table()))
    schema = layout(body).messages[0]
    fb = arrow_ipc._Flatbuffer(
        memoryview(bytes(body)), schema.metadata_start, schema.metadata_end, "schema"
    )
    table = fb.root().subtable(2)
    assert table is not None and table.field(0) is None and table.vsize >= 6
    vector = table.target(2)
    assert vector is not None and fb.u32(vector) == 1
    entry = vector - table.pos
    struct.pack_into("<H", body, table.vtable + 4, entry)
    struct.pack_into("<H", body, table.vtable + 2, max(table.tsize, entry + 2))
    return bytes(body)
