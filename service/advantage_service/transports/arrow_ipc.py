"""The framing and message metadata of an Arrow IPC stream, read before pyarrow reads any of it.

pyarrow's stream reader trusts what a stream declares: it allocates the uncompressed size a
compressed buffer claims before decompressing it, builds one object per record batch however
many there are, decodes schema metadata of any size, and leaves the offsets and dictionary
indices it reads unchecked (``RecordBatch.validate(full=True)`` checks them, once the batch is
built). So the codec first walks the stream here, in Python, where a bad position raises an
error instead of reading memory outside the body: every message's length prefix, its
flatbuffer (tables, vtables, vectors, each offset checked to stay inside the message's
metadata), and its body's span. From that walk it can refuse, before pyarrow allocates
anything, what no request needs: compressed buffers, too many messages, delta dictionaries,
an oversized schema, and row or token counts over the service's limits.

Layouts (format/Message.fbs, format/Schema.fbs of the Arrow specification)::

    message   := 0xFFFFFFFF | int32 metadata size | Message flatbuffer (padded) | body
    end       := 0xFFFFFFFF | 0x00000000
    Message   := version: short, header: union (type ubyte, table), bodyLength: long,
                 custom_metadata: [KeyValue]
    Schema    := endianness: short, fields: [Field], custom_metadata: [KeyValue], features
    RecordBatch := length: long, nodes: [FieldNode {length, null_count: long}],
                 buffers: [Buffer {offset, length: long}], compression: BodyCompression,
                 variadicBufferCounts: [long]
    DictionaryBatch := id: long, data: RecordBatch, isDelta: bool

The positions this module reports (``*_at``) are absolute offsets into the stream; the fuzzer in
the test suite uses them to mutate lengths and offsets where they are stored.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from functools import partialmethod

CONTINUATION = 0xFFFFFFFF
SCHEMA, DICTIONARY_BATCH, RECORD_BATCH = 1, 2, 3
HEADER_NAMES = {
    0: "empty",
    1: "schema",
    2: "dictionary batch",
    3: "record batch",
    4: "tensor",
    5: "sparse tensor",
}
# A FieldNode and a Buffer are both two little-endian int64: 16 bytes in their vectors.
STRUCT_BYTES = 16


class IpcError(ValueError):
    """The stream's framing or a message's metadata is malformed (the message says where)."""


class IpcLimit(IpcError):
    """The stream is well formed but over a bound: more batches, schema bytes or metadata
    entries than a request may have (``field`` names which)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class _Flatbuffer:
    """Bounds-checked reads of one flatbuffer: ``data[start:end]`` of the stream."""

    def __init__(self, data: memoryview, start: int, end: int, where: str) -> None:
        self.data = data
        self.start = start
        self.end = end
        self.where = where

    def _read(self, fmt: str, pos: int) -> int:
        size = struct.calcsize(fmt)
        if not self.start <= pos <= self.end - size:
            raise IpcError(f"{self.where}: its metadata points outside itself")
        value: int = struct.unpack_from(fmt, self.data, pos)[0]
        return value

    # The little-endian scalars of the format, by the names of its schema language.
    u8 = partialmethod(_read, "<B")
    i16 = partialmethod(_read, "<h")
    u16 = partialmethod(_read, "<H")
    i32 = partialmethod(_read, "<i")
    u32 = partialmethod(_read, "<I")
    i64 = partialmethod(_read, "<q")

    def root(self) -> _Table:
        return self.table(self.start + self.u32(self.start))

    def table(self, pos: int) -> _Table:
        vtable = pos - self.i32(pos)
        size = self.u16(vtable)
        if size < 4 or size % 2:
            raise IpcError(f"{self.where}: a table of its metadata is malformed")
        self.u16(vtable + size - 2)  # the whole vtable lies inside the flatbuffer
        return _Table(self, pos, vtable, size, self.u16(vtable + 2))


class _Table:
    def __init__(self, fb: _Flatbuffer, pos: int, vtable: int, vsize: int, tsize: int) -> None:
        self.fb = fb
        self.pos = pos
        self.vtable = vtable
        self.vsize = vsize
        self.tsize = tsize

    def field(self, slot: int) -> int | None:
        """The position of field ``slot``; None when absent (its default applies)."""
        entry = 4 + 2 * slot
        if entry >= self.vsize:
            return None
        offset = self.fb.u16(self.vtable + entry)
        if offset == 0:
            return None
        if offset >= self.tsize:
            raise IpcError(f"{self.fb.where}: a field of its metadata lies outside its table")
        return self.pos + offset

    def scalar(self, slot: int, kind: str, default: int = 0) -> int:
        pos = self.field(slot)
        if pos is None:
            return default
        return int(getattr(self.fb, kind)(pos))

    def target(self, slot: int) -> int | None:
        """Where the offset stored in field ``slot`` points (a table, vector or string)."""
        pos = self.field(slot)
        if pos is None:
            return None
        return pos + self.fb.u32(pos)

    def subtable(self, slot: int) -> _Table | None:
        pos = self.target(slot)
        return None if pos is None else self.fb.table(pos)

    def vector(self, slot: int, element_bytes: int) -> tuple[int, int]:
        """(count, position of the first element) of the vector in field ``slot``; (0, -1)
        when absent. The whole vector is checked to lie inside the flatbuffer."""
        pos = self.target(slot)
        if pos is None:
            return 0, -1
        count = self.fb.u32(pos)
        first = pos + 4
        if count and not first + count * element_bytes <= self.fb.end:
            raise IpcError(f"{self.fb.where}: a vector of its metadata runs past its end")
        return count, first


@dataclass(frozen=True)
class BatchLayout:
    """A RecordBatch table: the row count, and where its nodes and buffers are stored."""

    data: memoryview
    length: int
    length_at: int  # -1: absent (0 rows)
    node_count: int
    nodes_at: int
    buffer_count: int
    buffers_at: int
    compressed: bool
    variadic_counts: int

    def node(self, i: int) -> tuple[int, int]:
        """(length, null_count) of field node ``i``."""
        return self._entry(self.nodes_at, i)

    def buffer(self, i: int) -> tuple[int, int]:
        """(offset, length) of buffer ``i``, relative to the message's body."""
        return self._entry(self.buffers_at, i)

    def _entry(self, vector: int, i: int) -> tuple[int, int]:
        first, second = struct.unpack_from("<qq", self.data, vector + STRUCT_BYTES * i)
        return int(first), int(second)


@dataclass(frozen=True)
class Message:
    """One message of the stream: its kind, where its parts lie, what its header declares."""

    index: int
    kind: int
    start: int
    metadata_start: int
    metadata_end: int
    body_start: int
    body_end: int
    body_length_at: int  # -1: absent (no body)
    batch: BatchLayout | None  # a record batch, or a dictionary batch's data
    dictionary_id: int = 0
    is_delta: bool = False
    metadata_keys: int = 0  # a schema's custom_metadata entries

    @property
    def name(self) -> str:
        return f"message {self.index} ({HEADER_NAMES.get(self.kind, f'type {self.kind}')})"


@dataclass(frozen=True)
class StreamLayout:
    messages: list[Message]
    end: int  # the position after the end-of-stream marker
    big_endian: bool  # the schema declares big-endian buffers


def scan(
    body: bytes | bytearray | memoryview,
    *,
    max_messages: int,
    max_schema_bytes: int,
    max_metadata_keys: int,
) -> StreamLayout:
    """Walk the stream's messages up to its end-of-stream marker.

    Raises :class:`IpcError` for anything malformed or over a bound: the stream cut short or
    followed by other bytes, a message before the schema or a second schema, a tensor message,
    a schema message over ``max_schema_bytes`` or with more than ``max_metadata_keys`` metadata
    entries, more than ``max_messages`` messages after the schema (raised as
    :class:`IpcLimit`). Each batch's nodes and buffers are left for the codec to check against
    its schema (:func:`check_buffers`).
    """
    data = memoryview(body).cast("B")
    size = len(data)
    messages: list[Message] = []
    big_endian = False
    pos = 0
    while True:
        if pos + 8 > size:
            raise IpcError(
                "the Arrow IPC stream ends without its end-of-stream marker: the body is cut short"
            )
        marker, length = struct.unpack_from("<Ii", data, pos)
        if marker != CONTINUATION:
            raise IpcError(
                f"message {len(messages)} at byte {pos} does not start with the IPC continuation "
                "marker 0xFFFFFFFF (pre-0.15 framing or not an Arrow IPC stream)"
            )
        if length == 0:
            pos += 8
            break
        index = len(messages)
        if index > max_messages:  # the schema, then at most max_messages batches
            raise IpcLimit(
                f"the stream has more than {max_messages} record and dictionary batches "
                "(ADV_MAX_ARROW_BATCHES); write fewer, larger batches",
                "record_batches",
            )
        start, meta_start, meta_end = pos, pos + 8, pos + 8 + length
        if length < 0 or meta_end > size:
            raise IpcError(
                f"message {index} declares {length} bytes of metadata; the body is cut short"
            )
        fb = _Flatbuffer(data, meta_start, meta_end, f"message {index}")
        root = fb.root()
        kind = root.scalar(1, "u8")
        body_length = root.scalar(3, "i64")
        body_length_at = root.field(3)
        body_start = meta_end
        body_end = body_start + body_length
        name = f"message {index} ({HEADER_NAMES.get(kind, f'type {kind}')})"
        if body_length < 0 or body_end > size:
            raise IpcError(f"{name} declares a body of {body_length} bytes; the body is cut short")
        if kind not in (SCHEMA, DICTIONARY_BATCH, RECORD_BATCH):
            raise IpcError(f"{name}: only a schema, record batches and dictionaries may be sent")
        if (kind == SCHEMA) != (index == 0):
            raise IpcError(f"{name}: the stream must start with its schema, and have one")
        header = root.subtable(2)
        if header is None:
            raise IpcError(f"{name} has no header")
        message = Message(
            index=index,
            kind=kind,
            start=start,
            metadata_start=meta_start,
            metadata_end=meta_end,
            body_start=body_start,
            body_end=body_end,
            body_length_at=-1 if body_length_at is None else body_length_at,
            batch=None,
        )
        if kind == SCHEMA:
            if length > max_schema_bytes:
                raise IpcLimit(
                    f"the schema message has {length} bytes; the limit is {max_schema_bytes}: "
                    "keep the schema metadata to the request's options",
                    "schema",
                )
            big_endian = header.scalar(0, "i16") == 1  # Endianness.Big
            keys, _ = header.vector(2, 4)  # custom_metadata: [KeyValue]
            if keys > max_metadata_keys:
                raise IpcLimit(
                    f"the schema metadata has {keys} entries; the limit is {max_metadata_keys} "
                    "(the request's options go in advantage.request)",
                    "metadata",
                )
            message = replace(message, metadata_keys=keys)
        elif kind == RECORD_BATCH:
            message = replace(message, batch=_batch(header, name))
        else:
            data_table = header.subtable(1)
            if data_table is None:
                raise IpcError(f"{name} has no data")
            message = replace(
                message,
                batch=_batch(data_table, name),
                dictionary_id=header.scalar(0, "i64"),
                is_delta=bool(header.scalar(2, "u8")),
            )
        messages.append(message)
        pos = body_end
    if not messages:
        raise IpcError("the Arrow IPC stream has no schema")
    if pos != size:
        raise IpcError(
            f"the body has {size - pos} bytes after the Arrow IPC stream's end-of-stream marker"
        )
    return StreamLayout(messages, pos, big_endian)


def _batch(table: _Table, name: str) -> BatchLayout:
    """A RecordBatch table (its nodes and buffers are read on demand: their counts are checked
    against the schema first, so a vector of a million entries costs nothing)."""
    length = table.scalar(0, "i64")
    length_at = table.field(0)
    if length < 0:
        raise IpcError(f"{name} declares {length} rows")
    node_count, nodes_at = table.vector(1, STRUCT_BYTES)
    buffer_count, buffers_at = table.vector(2, STRUCT_BYTES)
    variadic, _ = table.vector(4, 8)
    return BatchLayout(
        data=table.fb.data,
        length=length,
        length_at=-1 if length_at is None else length_at,
        node_count=node_count,
        nodes_at=nodes_at,
        buffer_count=buffer_count,
        buffers_at=buffers_at,
        compressed=table.field(3) is not None,
        variadic_counts=variadic,
    )


def check_buffers(layout: BatchLayout, name: str, body_length: int) -> None:
    """Every buffer of ``layout`` inside its message's body of ``body_length`` bytes."""
    for i in range(layout.buffer_count):
        offset, length = layout.buffer(i)
        if offset < 0 or length < 0 or offset + length > body_length:
            raise IpcError(
                f"{name}: buffer {i} ({length} bytes at {offset}) lies outside the message body "
                f"of {body_length} bytes"
            )
