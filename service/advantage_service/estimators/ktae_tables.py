"""KTAE's batched contingency tables (:mod:`.ktae`).

The reference loops over groups and distinct tokens with dense vocabulary-sized arrays. Here one
sort of (group, token, rollout) keys over the whole batch yields every group's contingency tables
at once: runs of equal (group, token) are the tables, and a change of rollout inside a run is one
more rollout containing the token. After the sort, a table's counts are differences of the bounds
of its runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from ..batch import RolloutBatch, Span, fresh, repeat_runs

# Bits of the packed sort key: int64 without the sign bit (keys sort as signed integers).
KEY_BITS = 63


# ---- the batched contingency tables -----------------------------------------------------------


@dataclass
class _TableBounds:
    """Where each table's runs of sorted tokens start and end (int32 when they fit), from which
    its counts are differences: ``pair`` (R + 1,): the first token of each (table, rollout) pair,
    then K; per table, ``table_pair`` and ``table_token`` (M + 1,): its first pair and token,
    then R and K, and (M,) ``first_end``: the end of its first half in pairs, and ``wrong``: 1
    when that half is its wrong rollouts' (0: it has correct rollouts alone)."""

    pair: torch.Tensor
    table_pair: torch.Tensor
    table_token: torch.Tensor
    first_end: torch.Tensor
    wrong: torch.Tensor

    def cells(self, at: torch.Tensor | None = None) -> torch.Tensor:
        """int (5, M): a, b, occ_c, occ_w and the run of each table (of the tables ``at``)."""

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t if at is None else t.index_select(0, at)

        pair_lo, pair_hi = pick(self.table_pair[:-1]), pick(self.table_pair[1:])
        token_lo, token_hi = pick(self.table_token[:-1]), pick(self.table_token[1:])
        first_end, wrong = pick(self.first_end), pick(self.wrong)
        cells = fresh((5, pair_lo.numel()), pair_lo.dtype, pair_lo.device)
        torch.sub(first_end, pair_lo, out=cells[1]).mul_(wrong)
        torch.sub(pair_hi, pair_lo, out=cells[0]).sub_(cells[1])
        torch.sub(token_hi, token_lo, out=cells[4])
        wrong_end = self.pair.index_select(0, first_end)
        torch.sub(wrong_end, token_lo, out=cells[3]).mul_(wrong)
        torch.sub(cells[4], cells[3], out=cells[2])
        return cells


class KeyTokenTables:
    """Contingency counts per (group, token id) present in the batch.

    ``group``/``token``: int64 (M,); float64 (M,): ``a``/``b`` correct/wrong rollouts containing
    the token, ``occ_c``/``occ_w`` its occurrences in them. ``sorted_at`` (int64 (K,): the
    position of each tabulated token among them, table by table), ``kept_at`` (int64 (K,): the
    batch positions of the tabulated tokens, ascending; None: ``sorted_at`` holds batch
    positions) and ``run`` (int64 (M,): tokens per table) map per-table values back to token
    positions (:meth:`spread`, :attr:`order`); K < N when some tokens were left out (groups
    without contrast, ignored ids). ``starts``: int64 (M,), the first sorted position of each
    table.

    :func:`tabulate` gives them compact (int32 keys and run bounds, :meth:`compact`): the int64
    and float64 fields are made when first read, since a score without history or statistics
    reads few of them (:func:`table_scores` reads ``group32``, ``runs``, :meth:`single_side`
    and the counts of a few tables, :meth:`cells_at`).
    """

    def __init__(
        self,
        group: torch.Tensor,
        token: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        occ_c: torch.Tensor,
        occ_w: torch.Tensor,
        sorted_at: torch.Tensor,
        run: torch.Tensor,
        num_tokens: int,
        starts: torch.Tensor | None = None,
        kept_at: torch.Tensor | None = None,
    ) -> None:
        # (the cached properties' values, given)
        self.__dict__.update(group=group, token=token, a=a, b=b, occ_c=occ_c, occ_w=occ_w, run=run)
        if starts is not None:
            self.__dict__["starts"] = starts
        self.sorted_at, self.num_tokens, self.kept_at = sorted_at, num_tokens, kept_at
        self._heads: torch.Tensor | None = None
        self._vocab: torch.Tensor | None = None
        self._vocab_bits = 0
        self._bounds: _TableBounds | None = None

    @classmethod
    def compact(
        cls,
        heads: torch.Tensor,
        vocab_bits: int,
        vocab: torch.Tensor | None,
        bounds: _TableBounds,
        sorted_at: torch.Tensor,
        kept_at: torch.Tensor | None,
        num_tokens: int,
    ) -> KeyTokenTables:
        """Tables from ``heads`` (M,) group << vocab_bits | token (the index into ``vocab``
        when given) and the bounds of their runs."""
        tables = cls.__new__(cls)
        tables.sorted_at, tables.num_tokens, tables.kept_at = sorted_at, num_tokens, kept_at
        tables._heads, tables._vocab, tables._vocab_bits = heads, vocab, vocab_bits
        tables._bounds = bounds
        return tables

    @cached_property
    def group32(self) -> torch.Tensor:
        """int32 (M,): ``group``, as gathers index fastest."""
        if self._heads is None:
            return self.group.int()
        return (self._heads >> self._vocab_bits).int()

    @cached_property
    def cells(self) -> torch.Tensor:
        """int (5, M): a, b, occ_c, occ_w and the run of each table, whole."""
        if self._bounds is not None:
            return self._bounds.cells()
        return torch.stack(
            [self.a.long(), self.b.long(), self.occ_c.long(), self.occ_w.long(), self.run]
        )

    def cells_at(self, at: torch.Tensor) -> torch.Tensor:
        """int (5, len(at)): :attr:`cells` of the tables ``at``."""
        if self._bounds is not None and "cells" not in self.__dict__:
            return self._bounds.cells(at)
        return self.cells.index_select(1, at)

    @cached_property
    def runs(self) -> torch.Tensor:
        """int (M,): ``run``, int32 when the tables are compact."""
        if self._bounds is None:
            return self.run
        token = self._bounds.table_token
        return token[1:] - token[:-1]

    def single_side(self) -> torch.Tensor:
        """int (M,), fresh: 1 for a table of correct rollouts alone, 0 for one with wrong
        rollouts; for a table of a single token, whether that token's rollout is correct."""
        if self._bounds is None:
            return (self.b == 0).to(self.group32.dtype)
        return self._bounds.wrong.bitwise_xor(1)

    @cached_property
    def group(self) -> torch.Tensor:
        return self.group32.long()  # (made from the heads when compact)

    @cached_property
    def token(self) -> torch.Tensor:
        assert self._heads is not None
        token = (self._heads & ((1 << self._vocab_bits) - 1)).long()
        return token if self._vocab is None else self._vocab[token]

    @cached_property
    def _counts(self) -> torch.Tensor:
        """float64 (4, M): a, b, occ_c, occ_w, in one fresh block."""
        counts = self.cells[:4]
        return fresh(tuple(counts.shape), torch.float64, counts.device).copy_(counts)

    @cached_property
    def a(self) -> torch.Tensor:
        return self._counts[0]

    @cached_property
    def b(self) -> torch.Tensor:
        return self._counts[1]

    @cached_property
    def occ_c(self) -> torch.Tensor:
        return self._counts[2]

    @cached_property
    def occ_w(self) -> torch.Tensor:
        return self._counts[3]

    @cached_property
    def run(self) -> torch.Tensor:
        return self.runs.long()

    @cached_property
    def starts(self) -> torch.Tensor:
        if self._bounds is not None:
            return self._bounds.table_token[:-1].long()
        return torch.cumsum(self.run, 0) - self.run

    @property
    def order(self) -> torch.Tensor:
        """int64 (K,): the batch position of each tabulated token, table by table."""
        return self.sorted_at if self.kept_at is None else self.kept_at[self.sorted_at]

    @classmethod
    def empty(cls, num_tokens: int, device: torch.device) -> KeyTokenTables:
        """No tables (no tokens, or every group without contrast)."""
        i = torch.zeros(0, dtype=torch.int64, device=device)
        f = torch.zeros(0, dtype=torch.float64, device=device)
        return cls(i, i, f, f, f, f, i, i, num_tokens)

    def table_range(self, span: Span) -> tuple[int, int]:
        """The tables [lo, hi) of the groups of ``span`` (tables are ordered by group)."""
        bounds = torch.tensor([span.group_lo, span.group_hi], device=self.group.device)
        lo, hi = torch.searchsorted(self.group, bounds).tolist()
        return int(lo), int(hi)

    def select(self, span: Span) -> KeyTokenTables:
        """The tables of the groups of ``span`` (one request of a merged batch), renumbered
        from 0 and mapping to that request's tokens: what tabulating it alone gives."""
        m_lo, m_hi = self.table_range(span)
        starts = self.starts
        s_lo = int(starts[m_lo]) if m_hi > m_lo else 0
        s_hi = s_lo + int(self.run[m_lo:m_hi].sum())
        return KeyTokenTables(
            group=self.group[m_lo:m_hi] - span.group_lo,
            token=self.token[m_lo:m_hi],
            a=self.a[m_lo:m_hi],
            b=self.b[m_lo:m_hi],
            occ_c=self.occ_c[m_lo:m_hi],
            occ_w=self.occ_w[m_lo:m_hi],
            # (a request's tables hold its own tokens only)
            sorted_at=self.order[s_lo:s_hi] - span.token_lo,
            run=self.run[m_lo:m_hi],
            num_tokens=span.token_hi - span.token_lo,
            starts=starts[m_lo:m_hi] - s_lo,
        )

    def spread(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Per-table ``values`` (M,) -> per-token (N,), ``fill`` at tokens that were not
        tabulated."""
        out = fresh((self.num_tokens,), values.dtype, values.device)
        k = self.sorted_at.numel()
        if values.device.type == "cpu" and values.numel():
            per_token = torch.from_numpy(np.repeat(values.numpy(), self.runs.numpy()))
        else:
            per_token = repeat_runs(values, self.starts, k)
        if k != self.num_tokens:
            out.fill_(fill)
        # (scatter_: ~3x faster than out[order] = ... on CPU)
        if self.kept_at is None:
            return out.scatter_(0, self.sorted_at, per_token)
        # Placed among the tabulated tokens first, then at their batch positions in ascending
        # order: two scatters, cheaper than the batch position of each sorted token (a random
        # gather of int64 over the tabulated tokens).
        tabulated = fresh((k,), values.dtype, values.device).scatter_(0, self.sorted_at, per_token)
        return out.scatter_(0, self.kept_at, tabulated)

    def table_of_token(self) -> torch.Tensor:
        """int32 (N,): each token's table, M (one past the last) at tokens not tabulated. Many
        per-table values reach the tokens by one gather each (:func:`gather_tables`) instead of
        one :meth:`spread` each."""
        m = self.group32.numel()
        return self.spread(torch.arange(m, dtype=torch.int32, device=self.group32.device), m)


def gather_tables(
    values: torch.Tensor, table: torch.Tensor, fill: float = 0.0, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-table ``values`` (M,) at each token of ``table`` (:meth:`KeyTokenTables.
    table_of_token`): (N,) (into ``out`` when given), ``fill`` at tokens not tabulated."""
    extended = torch.cat([values, values.new_full((1,), fill)])
    if out is None:
        return extended.index_select(0, table)
    return torch.index_select(extended, 0, table, out=out)


def nonzero_indices(flags: torch.Tensor) -> torch.Tensor:
    """int64 positions where bool ``flags`` (K,) is true, ascending."""
    if flags.device.type == "cpu":  # (numpy's: several times torch's on the CPU)
        return torch.from_numpy(np.flatnonzero(flags.numpy()))
    return torch.nonzero(flags).squeeze(1)


def _run_bounds(values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 (runs + 1,): the first position of each run of equal ``values`` (sorted, (n,)),
    then n. ``out``: bool (n + 1,) scratch for the run starts' flags (fresh when None)."""
    n = values.numel()
    if out is None:
        out = torch.empty(n + 1, dtype=torch.bool, device=values.device)
    out[:1] = True
    torch.ne(values[1:], values[:-1], out=out[1:n])
    # (the end as one more flag: the bounds come out of one nonzero, with no copy to extend them)
    out[n] = True
    return nonzero_indices(out)


class _Scratch:
    """Named arrays carved from one fresh block (huge pages on the CPU), each 64-byte aligned:
    ``_Scratch(device, name=(size, dtype), ...)``, then ``scratch[name]``."""

    def __init__(self, device: torch.device, **arrays: tuple[int, torch.dtype]) -> None:
        offsets, total = {}, 0
        for name, (size, dtype) in arrays.items():
            offsets[name] = total
            total += -(-size * dtype.itemsize // 64) * 64
        block = fresh((max(total, 1),), torch.uint8, device)
        self._arrays = {
            name: block[offsets[name] : offsets[name] + size * dtype.itemsize].view(dtype)
            for name, (size, dtype) in arrays.items()
        }

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._arrays[name]


def tabulate(
    batch: RolloutBatch,
    correct: torch.Tensor,
    drop: torch.Tensor | None = None,
    ignore: torch.Tensor | None = None,
) -> KeyTokenTables:
    """Contingency tables of every (group, token id).

    correct: bool (B,). Tokens of rollouts where ``drop`` (bool (B,)) and token ids in ``ignore``
    are left out of the tables.
    """
    tokens = batch.tokens
    vocab = None
    # One key per token, bit-packed as group | token id | correct | rank of the rollout in its
    # group. Sorting it puts each table's tokens in one run, wrong before correct rollouts, and
    # the tokens of one rollout next to each other.
    rank_bits = max(1, (int(batch.group_sizes.max()) - 1).bit_length())
    group_bits = max(1, (batch.num_groups - 1).bit_length())
    vocab_bits = max(1, int(tokens.max()).bit_length()) if tokens.numel() else 1
    if group_bits + vocab_bits + 1 + rank_bits > KEY_BITS:  # huge ids: densify them first
        vocab, tokens = torch.unique(tokens.long(), return_inverse=True)
        vocab_bits = max(1, (vocab.numel() - 1).bit_length())
    # int32 keys when they fit (a training batch's do): they sort faster and halve the memory
    # every pass below moves.
    key_dtype = torch.int32 if group_bits + vocab_bits + 1 + rank_bits <= 31 else torch.int64
    low_bits = 1 + rank_bits
    prefix = (
        (batch.group_index << (vocab_bits + low_bits))
        | (correct.long() << rank_bits)
        | batch.rank_in_group
    ).to(key_dtype)
    key = batch.per_token(prefix)
    # (the kept rollouts' flags repeated: a pass over bytes, not over the keys)
    keep = batch.per_token(~drop) if drop is not None else None
    if ignore is not None and ignore.numel():
        not_ignored = ~torch.isin(batch.tokens, ignore.to(batch.tokens.dtype))
        keep = not_ignored if keep is None else keep & not_ignored
    # The token ids' bits are 0 in the prefix, so adding them is or-ing them, in one pass and no
    # temporary (a multiply, not <<: the shift has no vectorised CPU kernel).
    key.add_(tokens if tokens.dtype == key_dtype else tokens.to(key_dtype), alpha=1 << low_bits)
    kept_at = None if keep is None else nonzero_indices(keep)
    k = key.numel() if kept_at is None else kept_at.numel()
    # The arrays of the sorted tokens in one fresh block (huge pages on the CPU): fresh arrays
    # would cost more in page faults than the passes that fill them.
    scratch = _Scratch(
        key.device,
        sorted_key=(k, key_dtype),
        kept_key=(k if kept_at is not None else 0, key_dtype),
        new_pair=(k + 1, torch.bool),
    )
    if kept_at is not None:
        key = torch.index_select(key, 0, kept_at, out=scratch["kept_key"])
    # (the sorted positions outlive the scratch, in the tables: a fresh array of their own)
    sorted_at = fresh((k,), torch.int64, key.device)
    key, sorted_at = torch.sort(key, out=(scratch["sorted_key"], sorted_at))
    # Runs of equal keys are the (table, rollout) pairs, and the tokens are read once more only
    # for where the pairs start: the rest works on the pairs' keys, then on the halves of the
    # tables (group | token | correct), then on the tables, each a fraction of the tokens. A
    # table's counts are differences of the bounds of its runs at each level.
    pair_bound = _run_bounds(key, scratch["new_pair"])  # (R + 1,): tokens, then K
    half = key.index_select(0, pair_bound[:-1]).bitwise_right_shift_(rank_bits)
    half_bound = _run_bounds(half)  # (S + 1,): pairs, then R
    half_key = half.index_select(0, half_bound[:-1])
    table_key = half_key >> 1
    table_bound = _run_bounds(table_key)  # (M + 1,): halves, then S
    # A table's first half holds its wrong rollouts unless its correct bit is set (then it is
    # the only half). Bounds as int32 when they fit: torch's int64 arithmetic is several times
    # slower on the CPU, and every table's count is a few differences of them.
    if k < 2**31:
        pair_bound, half_bound = pair_bound.int(), half_bound.int()
    first = table_bound[:-1]
    table_pair = half_bound.index_select(0, table_bound)
    bounds = _TableBounds(
        pair=pair_bound,
        table_pair=table_pair,
        table_token=pair_bound.index_select(0, table_pair),
        first_end=half_bound[1:].index_select(0, first),
        wrong=half_key.index_select(0, first).bitwise_and_(1).bitwise_xor_(1),
    )
    return KeyTokenTables.compact(
        heads=table_key.index_select(0, first),
        vocab_bits=vocab_bits,
        vocab=vocab,
        bounds=bounds,
        sorted_at=sorted_at,
        kept_at=kept_at,
        num_tokens=batch.num_tokens,
    )
