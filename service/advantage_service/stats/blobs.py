"""The stored form of the vocabulary statistics, and how tables of them merge.

Redis stores these bytes (list and string values); the in-memory store keeps the tables
undecoded. Both share one merge, so they give the same numbers. (The records of the terms that
keep state are opaque bytes here: their formats belong to their terms.)

Vocabulary statistics: ``ADVT`` blob, one per request (a delta) or per namespace (compacted)::

    magic b"ADVT" | version u32 | flags u32 | rows u32 | rollouts u64
    | present float columns f64 (rows,) each | present count columns i32 or i64 (rows,) each
    | token ids i32 (rows,), strictly ascending

``flags`` bit i: column ``TOKEN_COLUMNS[i]`` is present (absent columns are all zero, e.g. those
of terms a request did not enable); bit ``WIDE_BIT``: counts are i64 (else i32). Every block
starts 8-byte aligned, so the decoder's ``np.frombuffer`` views need no copy.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

TOKENS_MAGIC = b"ADVT"
VERSION = 1
TOKENS_HEADER = struct.Struct("<4sIIIQ")
TOKEN_DTYPE = np.dtype("<i4")

# The columns of the format, in its order. ``correct``, ``wrong`` and ``occurrences`` are counted
# for every request; the others are filled by the terms that declare them (their writes).
FLOAT_COLUMNS = ("key_sum", "sens_sum")
COUNT_COLUMNS = ("correct", "wrong", "occurrences", "key_count", "sens_count")
TOKEN_COLUMNS = FLOAT_COLUMNS + COUNT_COLUMNS
WIDE_BIT = 1 << len(TOKEN_COLUMNS)
INT32_MAX = 2**31 - 1


# ---- vocabulary statistics ---------------------------------------------------------------------


@dataclass
class TokenStatsUpdate:
    """Vocabulary statistics, one entry per distinct token id: one request's increments, or a
    namespace's sums.

    ``tokens``: int64 (T,) ascending; ``correct``/``wrong``/``occurrences``/``key_count``/
    ``sens_count``: int64 (T,); ``key_sum``/``sens_sum``: float64 (T,).
    """

    rollouts: int
    tokens: np.ndarray
    correct: np.ndarray
    wrong: np.ndarray
    occurrences: np.ndarray
    key_sum: np.ndarray
    key_count: np.ndarray
    sens_sum: np.ndarray
    sens_count: np.ndarray


def empty_token_stats() -> TokenStatsUpdate:
    i, f = np.zeros(0, np.int64), np.zeros(0, np.float64)
    return TokenStatsUpdate(0, i, i, i, i, f, i, f, i)


def token_columns(stats: TokenStatsUpdate) -> dict[str, np.ndarray]:
    """The columns ``token_stats_response`` takes."""
    return {"token_id": stats.tokens, **{name: getattr(stats, name) for name in TOKEN_COLUMNS}}


def encode_token_stats(stats: TokenStatsUpdate) -> bytes:
    rows = int(stats.tokens.size)
    present = [np.asarray(getattr(stats, name)) for name in TOKEN_COLUMNS]
    flags = sum(1 << i for i, column in enumerate(present) if column.any())
    counts = [present[i] for i in range(len(FLOAT_COLUMNS), len(present)) if flags >> i & 1]
    wide = any(int(np.abs(c).max()) > INT32_MAX for c in counts)
    count_dtype = np.dtype("<i8" if wide else "<i4")
    parts = [
        TOKENS_HEADER.pack(
            TOKENS_MAGIC, VERSION, flags | (WIDE_BIT if wide else 0), rows, int(stats.rollouts)
        )
    ]
    for i, column in enumerate(present):
        if flags >> i & 1:
            dtype = np.dtype("<f8") if i < len(FLOAT_COLUMNS) else count_dtype
            parts.append(np.ascontiguousarray(column, dtype).tobytes())
    parts.append(np.ascontiguousarray(stats.tokens, TOKEN_DTYPE).tobytes())
    return b"".join(parts)


def decode_token_stats(blob: bytes | None) -> TokenStatsUpdate | None:
    """The blob's statistics (int64/float64 columns); None when absent or not one of ours."""
    if blob is None or len(blob) < TOKENS_HEADER.size:
        return None
    magic, version, flags, rows, rollouts = TOKENS_HEADER.unpack_from(blob)
    if magic != TOKENS_MAGIC or version != VERSION:
        return None
    count_dtype = np.dtype("<i8" if flags & WIDE_BIT else "<i4")
    offset = TOKENS_HEADER.size
    columns: dict[str, np.ndarray] = {}
    for i, name in enumerate(TOKEN_COLUMNS):
        is_float = i < len(FLOAT_COLUMNS)
        if not flags >> i & 1:
            columns[name] = np.zeros(rows, np.float64 if is_float else np.int64)
            continue
        dtype = np.dtype("<f8") if is_float else count_dtype
        if len(blob) < offset + dtype.itemsize * rows:
            return None
        column = np.frombuffer(blob, dtype, rows, offset)
        columns[name] = column if is_float else column.astype(np.int64)
        offset += dtype.itemsize * rows
    if len(blob) != offset + 4 * rows:
        return None
    tokens = np.frombuffer(blob, TOKEN_DTYPE, rows, offset).astype(np.int64)
    return TokenStatsUpdate(rollouts=int(rollouts), tokens=tokens, **columns)


def merge_token_stats(parts: Sequence[TokenStatsUpdate]) -> TokenStatsUpdate:
    """The sum of several statistics tables, over the union of their token ids."""
    parts = [p for p in parts if p.tokens.size or p.rollouts]
    if not parts:
        return empty_token_stats()
    if len(parts) == 1:
        return parts[0]
    rollouts = sum(int(p.rollouts) for p in parts)
    tokens = np.concatenate([p.tokens for p in parts])
    if tokens.size == 0:
        empty = empty_token_stats()
        empty.rollouts = rollouts
        return empty
    largest = int(tokens.max())
    if largest < max(4 * tokens.size, 1 << 20):
        # Token ids are a vocabulary's: count into a dense array, no sort.
        present = np.bincount(tokens, minlength=largest + 1) > 0
        uniq = np.flatnonzero(present)
        index, size = tokens, largest + 1
    else:
        uniq, index = np.unique(tokens, return_inverse=True)
        present, size = None, uniq.size
    columns = {}
    for name in TOKEN_COLUMNS:
        values = np.concatenate([getattr(p, name) for p in parts])
        summed = np.bincount(index, weights=values, minlength=size)
        if present is not None:
            summed = summed[present]
        columns[name] = summed if name in FLOAT_COLUMNS else np.rint(summed).astype(np.int64)
    return TokenStatsUpdate(rollouts=rollouts, tokens=uniq, **columns)


__all__ = [
    "COUNT_COLUMNS",
    "FLOAT_COLUMNS",
    "TOKEN_COLUMNS",
    "TokenStatsUpdate",
    "decode_token_stats",
    "empty_token_stats",
    "encode_token_stats",
    "merge_token_stats",
    "token_columns",
]
