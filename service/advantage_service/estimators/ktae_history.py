"""KTAE's history: its stored record, the prior a visit reads, and the update a visit writes.

Per (namespace, prompt id) the store keeps one record of the prompt's decayed counts: totals
n_c, n_w (correct and wrong rollouts), len_c, len_w (their tokens) and, per token id, a, b
(correct and wrong rollouts containing it) and occ_c, occ_w (its occurrences in them). The
prompt id is the group id (``RolloutBatch.prompt_ids`` when given).

A visit of group g reads the stored values H; H is this request's prior for g (ESTIMATORS.md,
"History": the prior is added to the group's own counts before steps 1-7). After the computation
the record becomes H' = d (H + current), with ``current`` the group's own counts and d the
request's ``history_decay``: the next visit's prior is the decayed sum. A group visited for the
first time has H = 0, so its scores equal the no-history scores.

Decay is eager: a visit decays every stored token of the prompt, those it does not contain too,
and drops the rows whose a + b + occ_c + occ_w falls below 1e-3 (``PRUNE_BELOW``), so a prompt
keeps the tokens of its last ~10 visits (at d = 0.5), not every token it ever saw. d = 0 forgets
everything. A visit reads the record whole and writes it whole. A replica's writer folds the
visits of one prompt that wait for the same write round in their order (:func:`fold_history`:
one write, as if they had been written one after the other, on top of what the first of them
read). Two replicas visiting one prompt at the same instant, or a visit that read the record
before an earlier round's write of it landed: the later write wins (one visit's counts are
lost); visits of one prompt are normally far apart in training.

The record (``ADVH``, little-endian; the store keeps it as opaque bytes under the key space
``history``)::

    magic b"ADVH" | version u32 | rows u64 | n_c, n_w, len_c, len_w f64
    | values f32 (rows, 4): a, b, occ_c, occ_w | token ids i32 (rows,), strictly ascending

A compressed record (``ADV_STATS_COMPRESSION=zstd``) has ``version`` 2 and, after the same
header, one zstd frame of the same rows in byte planes: byte j of every row's 16 value bytes
together (16 planes), then the four byte planes of the token ids' gaps (u32, the first gap from
0). Planes put the bytes that vary (low mantissa bytes, gaps) apart from those that barely do
(exponents, high bytes of small gaps), which is what lets zstd shrink a history about 8-11x;
decoding costs about as much CPU as moving the raw bytes would (see docs/deploy.md). Records of
either version are read, so the setting can change on a running deployment, and records written
by earlier releases (the same two versions) are read as they are.

float32 values: a visit reads the prompt's whole record, so its bytes are the read's cost;
float32 halves them against float64. Counts that are dyadic with at most 24 significant bits
(whole counts decayed by the default 0.5, or 0.25) are stored exactly; others carry a relative
rounding of at most 6e-8 per visit, which does not grow over visits (each visit decays the older
error with the count). The totals stay float64.
"""

from __future__ import annotations

import concurrent.futures
import os
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from ..batch import RolloutBatch

HISTORY_MAGIC = b"ADVH"
VERSION = 1
ZSTD_VERSION = 2  # a record whose rows are one zstd frame of byte planes
ZSTD_LEVEL = 3
HISTORY_HEADER = struct.Struct("<4sIQ4d")
VALUE_DTYPE = np.dtype("<f4")
TOKEN_DTYPE = np.dtype("<i4")
# The store's key space of these records (the key layout earlier releases wrote, kept so that
# replicas of both share history during a rolling upgrade).
SPACE = "history"

# A merged history row whose a + b + occ_c + occ_w falls below this is dropped. Its effect on a
# later score is below 1e-3 / n of a proportion, and without the cut a prompt would keep every
# token it ever saw. At decay 0.5 a token seen once leaves ~10 visits after its last appearance.
PRUNE_BELOW = 1e-3

# (group, token) keys pack the token id (< 2^31, see batch.INT32_LIMIT) into the low 32 bits.
TOKEN_BITS = 32


def prompt_ids(batch: RolloutBatch) -> list[str]:
    """The prompt id of each group, the key of its history (the group id when none was given)."""
    return list(batch.prompt_ids or batch.group_ids)


# ---- the record ---------------------------------------------------------------------------------


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
_DECODERS: list[concurrent.futures.ThreadPoolExecutor] = []
_DECODERS_LOCK = threading.Lock()


def _decoders() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that decompress a read's records (made on first use, one per core)."""
    with _DECODERS_LOCK:
        if not _DECODERS:
            _DECODERS.append(
                concurrent.futures.ThreadPoolExecutor(
                    max_workers=os.cpu_count() or 1, thread_name_prefix="history-decode"
                )
            )
        return _DECODERS[0]


def merge_history(
    stored: PromptHistory | None,
    totals: np.ndarray,
    tokens: np.ndarray,
    values: np.ndarray,
    decay: float,
    stored_rows: np.ndarray | None = None,
) -> PromptHistory:
    """H' = decay (H + current) over the union of token ids, rows below ``PRUNE_BELOW`` dropped.

    ``totals`` float64 (4,), ``tokens`` int (M,) strictly ascending and ``values`` float64
    (M, 4): this visit's own counts; ``stored_rows`` int (M,): each token's row in ``stored``,
    -1 where it has none (what the visit's lookup found; searched here when not given). In
    float64, rounded to float32 once. The stored rows (those of current ids gaining their
    counts) and the new ids are decayed and pruned apart, then merged: two sorted runs, which a
    stable sort merges in linear time. Rows move as single 16-byte items.
    """
    old = np.zeros(0, TOKEN_DTYPE) if stored is None else stored.tokens
    old_totals = np.zeros(4) if stored is None else np.asarray(stored.totals, np.float64)
    merged_old = (
        np.zeros((0, 4)) if stored is None else np.asarray(stored.values).astype(np.float64)
    )
    cur = np.asarray(tokens, TOKEN_DTYPE)
    cur_values = np.ascontiguousarray(values, np.float64)
    if stored_rows is None:
        stored_rows = _stored_rows(old, cur)
    hit = stored_rows >= 0
    # (each row as two complex128 items, in one dimension: numpy's fast path for a gather and
    # a scatter of 16-byte items; their additions are the float64 additions of the columns)
    pairs = (2 * stored_rows[hit])[:, None] + _PAIR
    gained = merged_old.reshape(-1).view(np.complex128)
    gained[pairs.reshape(-1)] += (
        cur_values.reshape(-1).view(np.complex128).reshape(-1, 2)[hit].reshape(-1)
    )
    merged_old *= decay
    new = np.flatnonzero(~hit)
    new_values = cur_values[new] * decay
    keep_old = np.flatnonzero(merged_old @ _ONES >= PRUNE_BELOW)
    keep_new = np.flatnonzero(new_values @ _ONES >= PRUNE_BELOW)
    merged_tokens = np.concatenate([old[keep_old], cur[new[keep_new]]])
    items = np.concatenate([_items(merged_old)[keep_old], _items(new_values)[keep_new]])
    if keep_old.size and keep_new.size:
        # Two sorted runs: the stable sort merges them in linear time.
        order = np.argsort(merged_tokens, kind="stable")
        merged_tokens, items = merged_tokens[order], items[order]
    return PromptHistory(
        decay * (old_totals + totals), merged_tokens, items.view(VALUE_DTYPE).reshape(-1, 4)
    )


_PAIR = np.arange(2)


def _stored_rows(old: np.ndarray, cur: np.ndarray) -> np.ndarray:
    """int64 (M,): the row of each of ``cur`` among ``old`` (both ascending), -1 where none."""
    if not old.size:
        return np.full(cur.size, -1, np.int64)
    pos = np.minimum(np.searchsorted(old, cur), old.size - 1)
    return np.where(old[pos] == cur, pos, -1)


def _items(values: np.ndarray) -> np.ndarray:
    """float64 (R, 4) -> float32 rows, one 16-byte (complex128) item each (R,)."""
    return np.ascontiguousarray(values, VALUE_DTYPE).view(np.complex128).reshape(-1)


_ONES = np.ones(4)


# Token ids below this take the lookup's dense scratch array (at most 16 MiB of int32); larger
# (sparse) ids take a binary search per prompt.
DENSE_LOOKUP_LIMIT = 1 << 22


# ---- what a visit reads -------------------------------------------------------------------------


@dataclass
class HistoryPrior:
    """Decayed counts from earlier visits, in the form ``ktae()`` merges.

    ``n_c``, ``n_w``, ``len_c``, ``len_w``: float64 (G,) per group of the batch (0 for a group
    without history). ``stored``: per group, the prompt's whole stored history as read (None:
    none); it stays on the CPU. KTAE asks it for the rows of its tables (:meth:`lookup`), and
    the write merges the request's counts into it.

    The read needs only the prompt ids, so it can run while KTAE builds its tables.
    """

    n_c: torch.Tensor
    n_w: torch.Tensor
    len_c: torch.Tensor
    len_w: torch.Tensor
    stored: list[PromptHistory | None]

    @classmethod
    def decode(cls, records: Sequence[bytes | None], device: torch.device) -> HistoryPrior:
        """The prior of a batch whose group g read ``records[g]`` (None: no history), with its
        totals on ``device``. Uncompressed records are viewed in place (no copy); compressed
        ones are decompressed in parallel, one record per thread (zstd releases the GIL)."""
        if any(is_compressed(record) for record in records):
            stored = list(_decoders().map(decode_history, records))
        else:
            stored = [decode_history(record) for record in records]
        return cls.from_stored(stored).to(device)

    @classmethod
    def from_stored(cls, stored: Sequence[PromptHistory | None]) -> HistoryPrior:
        """The prior of a batch whose group g has the stored history ``stored[g]``."""
        totals = np.zeros((len(stored), 4), np.float64)
        for g, history in enumerate(stored):
            if history is not None:
                totals[g] = history.totals
        columns = torch.from_numpy(totals).T.contiguous()
        return cls(columns[0], columns[1], columns[2], columns[3], list(stored))

    @property
    def num_groups(self) -> int:
        return int(self.n_c.numel())

    @property
    def rows(self) -> int:
        """Stored (prompt, token id) rows the read brought."""
        return sum(h.rows for h in self.stored if h is not None)

    def to(self, device: torch.device | str) -> HistoryPrior:
        """The same prior with its totals on ``device`` (the batch's)."""
        n_c, n_w, len_c, len_w = (
            t.to(device, non_blocking=True) for t in (self.n_c, self.n_w, self.len_c, self.len_w)
        )
        return HistoryPrior(n_c, n_w, len_c, len_w, self.stored)

    def lookup(
        self, group: torch.Tensor, token: torch.Tensor, method: str = "auto"
    ) -> torch.Tensor:
        """Prior a, b, occ_c, occ_w of (group, token id) pairs (int64 (M,) each): float64
        (M, 4) on ``group``'s device, zeros where there is none.

        ``method``: ``scratch`` (the CPU's dense scratch array), ``search`` (the accelerators'
        batched binary search, which also runs on the CPU) or ``auto`` (by the device)."""
        return self.lookup_rows(group, token, method)[0]

    def lookup_rows(
        self, group: torch.Tensor, token: torch.Tensor, method: str = "auto"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`lookup`, and where each pair's row is: int64 (M,) on ``group``'s device, its
        row in its prompt's stored history, -1 where it has none (the write merges the visit's
        counts into those rows without searching for them again)."""
        histories = [(i, h) for i, h in enumerate(self.stored) if h is not None and h.rows]
        if group.numel() == 0 or not histories:
            zeros = torch.zeros((group.numel(), 4), dtype=torch.float64, device=group.device)
            return zeros, torch.full((group.numel(),), -1, device=group.device)
        if method == "auto":
            method = "scratch" if group.device.type == "cpu" else "search"
        if method == "scratch":
            prior, rows = self._lookup_scratch(histories, group.numpy(), token.numpy())
        else:
            prior, rows = self._lookup_search(histories, group, token)
        # a <= n_c etc. hold exactly; the clamp only removes the float32 rounding of stored
        # values, so the rounded Fisher table stays a valid table.
        totals = torch.stack([self.n_c, self.n_w, self.len_c, self.len_w], 1).to(group.device)
        return torch.minimum(prior, totals.index_select(0, group), out=prior), rows

    def _lookup_scratch(
        self, histories: list[tuple[int, PromptHistory]], g: np.ndarray, t: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The CPU lookup. Per prompt, each pair marks its position at its token id in a dense
        scratch array, and every stored row reads the mark at its own token id back: O(stored
        rows + pairs), no sort and no search, every array walked in order except the scratch
        (sparse ids beyond ``DENSE_LOOKUP_LIMIT`` take a binary search instead). Marks left by
        other prompts are told apart by checking the pair's token id. Pairs sorted by group
        (KTAE's tables are) need no permutation."""
        found = np.zeros((g.size, 4), VALUE_DTYPE)
        row_of = np.full(g.size, -1, np.int64)
        order = None
        if not bool((g[1:] >= g[:-1]).all()):
            order = np.argsort(g, kind="stable")
            g, t = g[order], t[order]
        bounds = np.searchsorted(g, np.arange(self.num_groups + 1))
        vocab = max([int(t.max())] + [int(h.tokens[-1]) for _, h in histories])
        dense = vocab < DENSE_LOOKUP_LIMIT
        scratch = np.zeros(vocab + 1 if dense else 0, np.int32)
        positions = np.arange(g.size, dtype=np.int32)
        # One 16-byte item per row (four float32): rows move as single elements.
        rows_out = found.view(np.complex128).reshape(-1)
        for i, history in histories:
            lo, hi = int(bounds[i]), int(bounds[i + 1])
            if hi == lo:
                continue
            stored_tokens = history.tokens
            if dense:
                scratch[t[lo:hi]] = positions[lo:hi]
                pos = scratch[stored_tokens]
                np.clip(pos, lo, hi - 1, out=pos)
                rows = np.flatnonzero(t[pos] == stored_tokens)
                at = pos[rows]
            else:
                want = t[lo:hi]
                idx = np.minimum(np.searchsorted(stored_tokens, want), history.rows - 1)
                at = np.flatnonzero(stored_tokens[idx] == want)
                rows, at = idx[at], at + lo
            values = np.ascontiguousarray(history.values, VALUE_DTYPE)
            rows_out[at] = values.view(np.complex128).reshape(-1)[rows]
            row_of[at] = rows
        if order is not None:
            unsorted = np.empty_like(found)
            unsorted[order] = found
            found = unsorted
            unsorted_rows = np.empty_like(row_of)
            unsorted_rows[order] = row_of
            row_of = unsorted_rows
        return torch.from_numpy(found).double(), torch.from_numpy(row_of)

    def _lookup_search(
        self, histories: list[tuple[int, PromptHistory]], group: torch.Tensor, token: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The accelerator lookup: the stored rows go to the device once, keyed group << 32 |
        token id (ascending: prompts in group order, token ids ascending in each), and every
        pair finds its row with one batched binary search there."""
        device = group.device
        keys = np.concatenate(
            [(np.int64(i) << TOKEN_BITS) | h.tokens.astype(np.int64) for i, h in histories]
        )
        values = np.concatenate([np.asarray(h.values, VALUE_DTYPE) for _, h in histories])
        # Where each group's rows start among them (a row's index in its own prompt's history).
        first = np.zeros(self.num_groups, np.int64)
        first[[i for i, _ in histories]] = np.cumsum([0] + [h.rows for _, h in histories])[:-1]
        stored_keys = torch.from_numpy(keys).to(device)
        stored_values = torch.from_numpy(values).to(device)
        query = (group.long() << TOKEN_BITS) | token.long()
        idx = torch.searchsorted(stored_keys, query).clamp_(max=stored_keys.numel() - 1)
        missing = stored_keys.index_select(0, idx) != query
        prior = stored_values.index_select(0, idx).double()
        rows = idx - torch.from_numpy(first).to(device).index_select(0, group.long())
        return prior.masked_fill_(missing[:, None], 0.0), rows.masked_fill_(missing, -1)


@dataclass
class HistoryVisit:
    """What one visit of a prompt writes, before it is merged: ``stored`` the history it read
    (None: none), its own counts ``totals`` float64 (4,), ``tokens`` int32 (M,) strictly
    ascending and ``values`` float64 (M, 4), and the request's ``decay``; ``stored_rows``
    int64 (M,): each token's row in ``stored`` (-1: none), as the visit's lookup found them
    (None: not known)."""

    stored: PromptHistory | None
    totals: np.ndarray
    tokens: np.ndarray
    values: np.ndarray
    decay: float
    stored_rows: np.ndarray | None = None


def history_visits(
    prompts: Sequence[str],
    totals: torch.Tensor,
    group: torch.Tensor,
    token: torch.Tensor,
    current: torch.Tensor,
    prior: HistoryPrior,
    decay: float,
    stored_rows: torch.Tensor | None = None,
) -> dict[str, HistoryVisit]:
    """The visits of a batch's prompts, keyed by prompt id: each one's record is
    H' = d (H + current) (:func:`fold_history`).

    ``totals``: float64 (G, 4) each group's own n_c, n_w, len_c, len_w; ``group``, ``token``:
    int64 (M,) this request's (group, token id) tables, ``current``: float64 (M, 4) their own
    a, b, occ_c, occ_w; ``prior``: what the visit read; ``stored_rows``: int64 (M,) each
    table's row in its prompt's stored history (-1: none), as the lookup found them.
    """
    keys = (group << TOKEN_BITS) | token
    if keys.numel() > 1 and not bool((keys[1:] > keys[:-1]).all()):
        order = torch.sort(keys).indices
        group, token, current = group[order], token[order], current[order]
        stored_rows = None if stored_rows is None else stored_rows[order]
    group_np = group.cpu().numpy()
    tokens_np = token.cpu().numpy().astype(TOKEN_DTYPE)
    current_np = current.double().cpu().numpy()
    rows_np = None if stored_rows is None else stored_rows.cpu().numpy()
    bounds = np.searchsorted(group_np, np.arange(len(prompts) + 1)).tolist()
    totals_np = totals.double().cpu().numpy()
    return {
        prompt: HistoryVisit(
            prior.stored[g],
            totals_np[g],
            tokens_np[bounds[g] : bounds[g + 1]],
            current_np[bounds[g] : bounds[g + 1]],
            decay,
            None if rows_np is None else rows_np[bounds[g] : bounds[g + 1]],
        )
        for g, prompt in enumerate(prompts)
    }


def fold_history(visits: Sequence[HistoryVisit], compress: bool = False) -> bytes:
    """The record several visits of one prompt leave, in their order: the first one's stored
    history, then H' = d (H + current) per visit, as writing them one after the other would
    (each merge rounds to float32 as a stored record does, so the bytes are the same). A later
    visit's own read is not used: it is, or is older than, what the visits before it leave
    (and so are the rows its lookup found: the first visit's alone are where they say)."""
    history = visits[0].stored
    for i, visit in enumerate(visits):
        history = merge_history(
            history,
            visit.totals,
            visit.tokens,
            visit.values,
            visit.decay,
            visit.stored_rows if i == 0 else None,
        )
    assert history is not None
    return encode_history(history, compress)


__all__ = [
    "PRUNE_BELOW",
    "SPACE",
    "HistoryPrior",
    "HistoryVisit",
    "PromptHistory",
    "decode_history",
    "encode_history",
    "fold_history",
    "history_visits",
    "is_compressed",
    "merge_history",
    "prompt_ids",
]
