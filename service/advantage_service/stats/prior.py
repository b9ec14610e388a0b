"""What a visit reads: the KTAE history prior of a batch, and its lookup of KTAE's tables.

The semantics of history (what is stored, how it decays, when it is written) are in
:mod:`.base`; the stored record is :class:`.blobs.PromptHistory`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..batch import RolloutBatch
from ..request import ComputeRequest
from .blobs import VALUE_DTYPE, PromptHistory

# (group, token) keys pack the token id (< 2^31, see batch.INT32_LIMIT) into the low 32 bits.
TOKEN_BITS = 32


def wants_history(req: ComputeRequest) -> bool:
    """True when the request's KTAE term asked for per-prompt history."""
    ktae = req.estimator.terms.get("ktae")
    return ktae is not None and ktae["history"] != "none"


def prompt_ids(batch: RolloutBatch) -> list[str]:
    """The prompt id of each group, the key of its history (the group id when none was given)."""
    return list(batch.prompt_ids or batch.group_ids)


# Token ids below this take the lookup's dense scratch array (at most 16 MiB of int32); larger
# (sparse) ids take a binary search per prompt.
DENSE_LOOKUP_LIMIT = 1 << 22


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

    def lookup(self, group: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """Prior a, b, occ_c, occ_w of (group, token id) pairs (int64 (M,) each): float64
        (M, 4) on ``group``'s device, zeros where there is none."""
        histories = [(i, h) for i, h in enumerate(self.stored) if h is not None and h.rows]
        if group.numel() == 0 or not histories:
            return torch.zeros((group.numel(), 4), dtype=torch.float64, device=group.device)
        if group.device.type == "cpu":
            prior = self._lookup_scratch(histories, group.numpy(), token.numpy())
        else:
            prior = self._lookup_search(histories, group, token)
        # a <= n_c etc. hold exactly; the clamp only removes the float32 rounding of stored
        # values, so the rounded Fisher table stays a valid table.
        totals = torch.stack([self.n_c, self.n_w, self.len_c, self.len_w], 1).to(group.device)
        return torch.minimum(prior, totals.index_select(0, group), out=prior)

    def _lookup_scratch(
        self, histories: list[tuple[int, PromptHistory]], g: np.ndarray, t: np.ndarray
    ) -> torch.Tensor:
        """The CPU lookup. Per prompt, each pair marks its position at its token id in a dense
        scratch array, and every stored row reads the mark at its own token id back: O(stored
        rows + pairs), no sort and no search, every array walked in order except the scratch
        (sparse ids beyond ``DENSE_LOOKUP_LIMIT`` take a binary search instead). Marks left by
        other prompts are told apart by checking the pair's token id. Pairs sorted by group
        (KTAE's tables are) need no permutation."""
        found = np.zeros((g.size, 4), VALUE_DTYPE)
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
        if order is not None:
            unsorted = np.empty_like(found)
            unsorted[order] = found
            found = unsorted
        return torch.from_numpy(found).double()

    def _lookup_search(
        self, histories: list[tuple[int, PromptHistory]], group: torch.Tensor, token: torch.Tensor
    ) -> torch.Tensor:
        """The accelerator lookup: the stored rows go to the device once, keyed group << 32 |
        token id (ascending: prompts in group order, token ids ascending in each), and every
        pair finds its row with one batched binary search there."""
        device = group.device
        keys = np.concatenate(
            [(np.int64(i) << TOKEN_BITS) | h.tokens.astype(np.int64) for i, h in histories]
        )
        values = np.concatenate([np.asarray(h.values, VALUE_DTYPE) for _, h in histories])
        stored_keys = torch.from_numpy(keys).to(device)
        stored_values = torch.from_numpy(values).to(device)
        query = (group.long() << TOKEN_BITS) | token.long()
        idx = torch.searchsorted(stored_keys, query).clamp_(max=stored_keys.numel() - 1)
        missing = stored_keys.index_select(0, idx) != query
        prior = stored_values.index_select(0, idx).double()
        return prior.masked_fill_(missing[:, None], 0.0)


__all__ = ["DENSE_LOOKUP_LIMIT", "TOKEN_BITS", "HistoryPrior", "prompt_ids", "wants_history"]
