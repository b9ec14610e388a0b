"""The stored forms of history and vocabulary statistics, and how they merge.

Redis stores these bytes (string and list values); the in-memory store keeps the same records
undecoded (float32 values included). Both share one merge, so they give the same numbers.

History of one (namespace, prompt): ``ADVH`` blob, little-endian::

    magic b"ADVH" | version u32 | rows u64 | n_c, n_w, len_c, len_w f64
    | values f32 (rows, 4): a, b, occ_c, occ_w | token ids i32 (rows,), strictly ascending

A compressed record (``ADV_STATS_COMPRESSION=zstd``) has ``version`` 2 and, after the same
header, one zstd frame of the same rows in byte planes: byte j of every row's 16 value bytes
together (16 planes), then the four byte planes of the token ids' gaps (u32, the first gap from
0). Planes put the bytes that vary (low mantissa bytes, gaps) apart from those that barely do
(exponents, high bytes of small gaps), which is what lets zstd shrink a history about 8-11x;
decoding costs about as much CPU as moving the raw bytes would (see docs/deploy.md). Records of
either version are read, so the setting can change on a running deployment.

float32 values: a visit reads the prompt's whole blob, so its bytes are the read's cost; float32
halves them against float64. Counts that are dyadic with at most 24 significant bits (whole
counts decayed by the default 0.5, or 0.25) are stored exactly; others carry a relative rounding
of at most 6e-8 per visit, which does not grow over visits (each visit decays the older error
with the count). The totals stay float64.

Vocabulary statistics: ``ADVT`` blob, one per request (a delta) or per namespace (compacted)::

    magic b"ADVT" | version u32 | flags u32 | rows u32 | rollouts u64
    | present float columns f64 (rows,) each | present count columns i32 or i64 (rows,) each
    | token ids i32 (rows,), strictly ascending

``flags`` bit i: column ``TOKEN_COLUMNS[i]`` is present (absent columns are all zero, e.g. the
KTAE and CSCR ones of a GRPO request); bit ``WIDE_BIT``: counts are i64 (else i32). Every block
starts 8-byte aligned, so the decoder's ``np.frombuffer`` views need no copy.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import zstandard

HISTORY_MAGIC = b"ADVH"
TOKENS_MAGIC = b"ADVT"
VERSION = 1
ZSTD_VERSION = 2  # a history record whose rows are one zstd frame of byte planes
# How history records are written (ADV_STATS_COMPRESSION); both kinds are always read.
Compression = Literal["none", "zstd"]
ZSTD_LEVEL = 3
HISTORY_HEADER = struct.Struct("<4sIQ4d")
TOKENS_HEADER = struct.Struct("<4sIIIQ")
VALUE_DTYPE = np.dtype("<f4")
TOKEN_DTYPE = np.dtype("<i4")

# A merged history row whose a + b + occ_c + occ_w falls below this is dropped. Its effect on a
# later score is below 1e-3 / n of a proportion, and without the cut a prompt would keep every
# token it ever saw. At decay 0.5 a token seen once leaves ~10 visits after its last appearance.
PRUNE_BELOW = 1e-3

FLOAT_COLUMNS = ("key_sum", "sens_sum")
COUNT_COLUMNS = ("correct", "wrong", "occurrences", "key_count", "sens_count")
TOKEN_COLUMNS = FLOAT_COLUMNS + COUNT_COLUMNS
WIDE_BIT = 1 << len(TOKEN_COLUMNS)
INT32_MAX = 2**31 - 1


# ---- history -------------------------------------------------------------------------------


@dataclass
class PromptHistory:
    """The stored history of one prompt: ``totals`` float64 (4,) n_c, n_w, len_c, len_w;
    ``tokens`` int32 (R,) strictly ascending; ``values`` float32 (R, 4) a, b, occ_c, occ_w."""

    totals: np.ndarray
    tokens: np.ndarray
    values: np.ndarray

    @property
    def rows(self) -> int:
        return int(self.tokens.size)


def encode_history(history: PromptHistory, compress: bool = False) -> bytes:
    values = np.ascontiguousarray(history.values, dtype=VALUE_DTYPE)
    tokens = np.ascontiguousarray(history.tokens, dtype=TOKEN_DTYPE)
    header = HISTORY_HEADER.pack(
        HISTORY_MAGIC,
        ZSTD_VERSION if compress else VERSION,
        tokens.size,
        *np.asarray(history.totals, np.float64).tolist(),
    )
    if not compress:
        return b"".join((header, values.tobytes(), tokens.tobytes()))
    gaps = np.diff(tokens.astype(np.int64), prepend=0).astype("<u4")
    planes = b"".join(
        (
            values.view(np.uint8).reshape(-1, 16).T.tobytes(),
            gaps.view(np.uint8).reshape(-1, 4).T.tobytes(),
        )
    )
    return header + _CODECS.compressor.compress(planes)


def decode_history(blob: bytes | None) -> PromptHistory | None:
    """The blob's history; None when absent or not one of ours. An uncompressed record's arrays
    are views into ``blob`` (no copy); a compressed one is decompressed (in the calling thread:
    call it from a worker thread, zstd releases the GIL)."""
    if blob is None or len(blob) < HISTORY_HEADER.size:
        return None
    magic, version, rows, *totals = HISTORY_HEADER.unpack_from(blob)
    start = HISTORY_HEADER.size
    if magic != HISTORY_MAGIC:
        return None
    if version == ZSTD_VERSION:
        try:
            planes = _CODECS.decompressor.decompress(
                memoryview(blob)[start:], max_output_size=20 * rows
            )
        except zstandard.ZstdError:
            return None
        if len(planes) != 20 * rows:
            return None
        flat = np.frombuffer(planes, np.uint8)
        value_bytes = np.ascontiguousarray(flat[: 16 * rows].reshape(16, rows).T)
        gaps = np.ascontiguousarray(flat[16 * rows :].reshape(4, rows).T).view("<u4")
        tokens = np.cumsum(gaps.reshape(rows), dtype=np.int64).astype(TOKEN_DTYPE)
        return PromptHistory(
            np.array(totals, np.float64), tokens, value_bytes.view(VALUE_DTYPE).reshape(rows, 4)
        )
    if version != VERSION or len(blob) != start + 20 * rows:
        return None
    values = np.frombuffer(blob, VALUE_DTYPE, 4 * rows, start).reshape(rows, 4)
    tokens = np.frombuffer(blob, TOKEN_DTYPE, rows, start + 16 * rows)
    return PromptHistory(np.array(totals, np.float64), tokens, values)


def is_compressed(blob: bytes | None) -> bool:
    """True for a compressed history record (decoding it is real work, not a view)."""
    return (
        blob is not None
        and len(blob) >= HISTORY_HEADER.size
        and blob[:4] == HISTORY_MAGIC
        and struct.unpack_from("<I", blob, 4)[0] == ZSTD_VERSION
    )


class _Codecs(threading.local):
    """zstd contexts are not thread-safe: each thread gets its own pair on first use."""

    def __init__(self) -> None:
        # (with a checksum: a damaged record reads as absent, never as wrong counts)
        self.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True)
        self.decompressor = zstandard.ZstdDecompressor()


_CODECS = _Codecs()


def merge_history(
    stored: PromptHistory | None,
    totals: np.ndarray,
    tokens: np.ndarray,
    values: np.ndarray,
    decay: float,
) -> PromptHistory:
    """H' = decay (H + current) over the union of token ids, rows below ``PRUNE_BELOW`` dropped.

    ``totals`` float64 (4,), ``tokens`` int (M,) strictly ascending and ``values`` float64
    (M, 4): this visit's own counts. In float64, rounded to float32 once. The stored rows and
    the new tokens are decayed and pruned apart, then merged: two sorted runs, which a stable
    sort merges in linear time. Rows move as single 16-byte items.
    """
    old = np.zeros(0, TOKEN_DTYPE) if stored is None else stored.tokens
    old_totals = np.zeros(4) if stored is None else np.asarray(stored.totals, np.float64)
    merged_old = (
        np.zeros((0, 4)) if stored is None else np.asarray(stored.values).astype(np.float64)
    )
    cur = np.asarray(tokens).astype(TOKEN_DTYPE)
    cur_values = np.asarray(values, np.float64)
    if old.size and cur.size:
        # Where each current token falls among the stored ones; the stored ones gain its counts.
        pos = np.minimum(np.searchsorted(old, cur), old.size - 1)
        found = np.flatnonzero(old[pos] == cur)
        cells = (pos[found][:, None] * 4 + np.arange(4)).reshape(-1)
        merged_old.reshape(-1)[cells] += cur_values[found].reshape(-1)
        new = np.ones(cur.size, bool)
        new[found] = False
        cur, cur_values = cur[new], cur_values[new]
    merged_old *= decay
    cur_values = cur_values * decay
    keep_old = np.flatnonzero(merged_old @ _ONES >= PRUNE_BELOW)
    keep_new = np.flatnonzero(cur_values @ _ONES >= PRUNE_BELOW)
    merged_tokens = np.concatenate([old[keep_old], cur[keep_new]])
    rows = np.concatenate([_rows(merged_old)[keep_old], _rows(cur_values)[keep_new]])
    if keep_old.size and keep_new.size:
        order = np.argsort(merged_tokens, kind="stable")
        merged_tokens, rows = merged_tokens[order], rows[order]
    return PromptHistory(
        decay * (old_totals + totals), merged_tokens, rows.view(VALUE_DTYPE).reshape(-1, 4)
    )


_ONES = np.ones(4)
_ROW = np.dtype((np.void, 4 * VALUE_DTYPE.itemsize))


def _rows(values: np.ndarray) -> np.ndarray:
    """float64 (R, 4) -> float32 rows, one 16-byte item each (R,)."""
    return np.ascontiguousarray(values, VALUE_DTYPE).view(_ROW).reshape(-1)


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
    "PRUNE_BELOW",
    "Compression",
    "PromptHistory",
    "TokenStatsUpdate",
    "decode_history",
    "decode_token_stats",
    "empty_token_stats",
    "encode_history",
    "encode_token_stats",
    "is_compressed",
    "merge_history",
    "merge_token_stats",
    "token_columns",
]
