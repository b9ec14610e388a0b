"""The stats-store interface, the KTAE history prior, and the updates a request writes.

KTAE history (``"ktae": {"history": "prompt", "history_decay": d}``)
--------------------------------------------------------------------
Per (namespace, prompt id) the store keeps totals n_c, n_w (correct and wrong rollouts), len_c,
len_w (their tokens) and, per token id, a, b (correct and wrong rollouts containing it) and occ_c,
occ_w (its occurrences in them). The prompt id is the group id (``RolloutBatch.prompt_ids``).

A visit of group g reads the stored values H; H is this request's prior for g (ESTIMATORS.md,
"History": the prior is added to the group's own counts before steps 1-7). After the computation
the store writes H' = d (H + current), with ``current`` the group's own counts and d the
request's ``history_decay``: the next visit's prior is the decayed sum. A group visited for the
first time has H = 0, so its scores equal the no-history scores.

Decay is eager: a visit decays every stored token of the prompt, those it does not contain too,
and drops the rows whose a + b + occ_c + occ_w falls below 1e-3 (``blobs.PRUNE_BELOW``), so a
prompt keeps the tokens of its last ~10 visits (at d = 0.5), not every token it ever saw.
d = 0 forgets everything. A prompt's history is one record (``blobs``: float64 totals, float32
per-token values): a visit reads it whole and writes it whole.

What is written: only when the read succeeded. A request that asked for history while the store
was down is computed without it (``summary.history = "unavailable"``) and writes no history, so an
outage never overwrites stored history with one visit's counts. Token statistics are still
counted. Two replicas visiting one prompt at the same instant: the later write wins (one visit's
counts are lost); visits of one prompt are normally far apart in training.

Vocabulary statistics (per namespace, every request)
----------------------------------------------------
Per token id: ``correct_rollouts`` / ``wrong_rollouts`` (rollouts containing it with reward > 0 /
<= 0; presence, not counts), ``occurrences``, the KTAE score summed over the (group, token) tables
that KTAE scored (groups whose merged counts have both correct and wrong rollouts; ignored token
ids are never scored) with their count (``key_score`` = the mean), and the CSCR sensitivity
|logp_pos - logp_neg| summed over the token's occurrences where CSCR ran with their count
(``mean_sensitivity``). Plus ``rollouts_counted``. Orders: ``key`` = |key_score| descending
(strong evidence either way first; the sign says which way), ``sensitivity`` = mean_sensitivity
descending, ``occurrences`` descending; tokens without a value for the order come last, ties go
to the lower token id.

Every stored entry expires ``ttl_seconds`` (``ADV_STATS_TTL_SECONDS``) after its last write.

Idempotency
-----------
A request whose client sent ``request_id`` is counted at most once per namespace for the TTL:
the store's first write claims the id, and writes of a request that did not claim it are skipped
(statistics and history unchanged). The request itself is still computed and answered.

The engine's order of calls, per request:

1. only when ``wants_history(req)``: start ``store.read_history(req.namespace, prompt_ids)``
   (the batch's prompt ids; it answers None when the store is down, ``summary.history =
   "unavailable"``, otherwise ``"applied"``), and at once
2. compute with ``TermContext(ktae_prior=<a future of the prior>, collect_ktae_tables=True)``:
   KTAE builds its tables while the read is in flight and waits for it only then;
3. answer;
4. ``update = build_updates(req, result, prior)`` (tensor work: on a compute worker) and
   ``await store.record(req.namespace, req.request_id if req.client_request_id else None,
   update)``, scheduled after the answer so that writes never delay it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import torch

from ..batch import RolloutBatch
from ..estimators import AdvantageResult
from ..estimators.cscr import sensitivity
from ..estimators.ktae import KeyTokenTables
from ..request import ComputeRequest
from .blobs import INT32_MAX, VALUE_DTYPE, PromptHistory, TokenStatsUpdate, merge_history

# (group, token) keys pack the token id (< 2^31, see batch.INT32_LIMIT) into the low 32 bits.
TOKEN_BITS = 32

ORDERS = ("key", "sensitivity", "occurrences")
StoreStatus = Literal["memory", "up", "down"]


def wants_history(req: ComputeRequest) -> bool:
    """True when the request's KTAE term asked for per-prompt history."""
    ktae = req.estimator.terms.get("ktae")
    return ktae is not None and ktae["history"] != "none"


def prompt_ids(batch: RolloutBatch) -> list[str]:
    """The prompt id of each group, the key of its history (the group id when none was given)."""
    return list(batch.prompt_ids or batch.group_ids)


# ---- what a visit reads: the prior KTAE merges -------------------------------------------------

# Largest token id for which a lookup marks stored rows in a dense scratch array (16 MiB of
# int32); beyond it (sparse ids), a binary search per prompt.
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


# ---- what a request writes ------------------------------------------------------------------


@dataclass
class HistoryUpdate:
    """New stored history H' = d (H + current) of the batch's prompts: ``prompts[g]`` is what
    ``prompt_ids[g]`` stores (rows merged over the union of token ids and pruned)."""

    prompt_ids: list[str]
    prompts: list[PromptHistory]


@dataclass
class StatsUpdate:
    """Everything one request writes: history (None: nothing to write) and token statistics."""

    history: HistoryUpdate | None
    tokens: TokenStatsUpdate


def _segment_sum(index: torch.Tensor, values: torch.Tensor, size: int) -> torch.Tensor:
    return torch.zeros(size, dtype=values.dtype, device=values.device).index_add_(0, index, values)


def _empty_tables(device: torch.device) -> KeyTokenTables:
    """The tables of a batch without tokens (KTAE returns none then)."""
    i, f = (torch.zeros(0, dtype=d, device=device) for d in (torch.int64, torch.float64))
    return KeyTokenTables(i, i, f, f, f, f, i, i, None, 0)


def _history_update(
    batch: RolloutBatch,
    tables: KeyTokenTables,
    prior: HistoryPrior,
    params: dict[str, Any],
) -> HistoryUpdate:
    g_count = batch.num_groups
    decay = float(params["history_decay"])
    correct = (batch.rewards > params["correct_threshold"]).double()
    lengths = batch.lengths.double()
    n_c = _segment_sum(batch.group_index, correct, g_count)
    len_c = _segment_sum(batch.group_index, lengths * correct, g_count)
    len_all = _segment_sum(batch.group_index, lengths, g_count)
    totals = torch.stack([n_c, batch.group_sizes.double() - n_c, len_c, len_all - len_c], dim=1)

    # The tables hold this request's own counts, one row per (group, token id).
    keys = (tables.group << TOKEN_BITS) | tables.token
    current = torch.stack([tables.a, tables.b, tables.occ_c, tables.occ_w], dim=1).double()
    if keys.numel() > 1 and not bool((keys[1:] > keys[:-1]).all()):
        keys, order = torch.sort(keys)
        current = current[order]
    keys_np, current_np = keys.cpu().numpy(), current.cpu().numpy()
    bounds = np.searchsorted(keys_np >> TOKEN_BITS, np.arange(g_count + 1)).tolist()
    totals_np = totals.cpu().numpy()
    stored = prior.stored
    token_mask = (1 << TOKEN_BITS) - 1
    prompts = [
        merge_history(
            stored[g],
            totals_np[g],
            keys_np[bounds[g] : bounds[g + 1]] & token_mask,
            current_np[bounds[g] : bounds[g + 1]],
            decay,
        )
        for g in range(g_count)
    ]
    return HistoryUpdate(prompt_ids=prompt_ids(batch), prompts=prompts)


def _distinct_tokens(
    tokens: torch.Tensor,
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """The distinct token ids (ascending) and a map of token ids to their index among them.
    Token ids are a vocabulary's: usually a dense table, no sort; sparse ids take one sort."""
    vocab = int(tokens.max()) + 1 if tokens.numel() else 0
    if vocab <= max(4 * tokens.numel(), 1 << 20):
        present = torch.bincount(tokens, minlength=vocab) > 0
        index = torch.cumsum(present, 0) - 1
        return torch.nonzero(present).squeeze(1), lambda t: index[t]
    uniq = torch.unique(tokens)
    return uniq, lambda t: torch.searchsorted(uniq, t)


def _distinct(keys: torch.Tensor) -> torch.Tensor:
    """The distinct values of int64 ``keys`` >= 0, ascending, int64.

    On the CPU numpy's sort of int32 is several times torch's (``torch.unique`` sorts too), so
    keys that fit in int32 are sorted there and deduplicated by comparing neighbours."""
    if keys.device.type != "cpu" or keys.numel() == 0 or int(keys.max()) > INT32_MAX:
        return torch.unique(keys)
    ordered = np.sort(keys.numpy().astype(np.int32))
    first = np.ones(ordered.size, bool)
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    return torch.from_numpy(ordered[first].astype(np.int64))


def build_updates(
    req: ComputeRequest, result: AdvantageResult, prior: HistoryPrior | None
) -> StatsUpdate:
    """The writes of one computed request (vectorised over the batch, on the result's device).

    ``result`` must come from ``TermContext(collect_ktae_tables=True, ktae_prior=prior)`` when
    the estimator has KTAE. ``prior``: what ``read_history`` returned (None when the request did
    not ask for history or the store was down: then no history is written).
    """
    spec = result.estimator or req.estimator
    device = result.advantages.device
    batch = req.batch.to(device)
    tokens = batch.tokens.long()
    rollout = batch.rollout_of_token

    uniq, dense_of = _distinct_tokens(tokens)
    dense = dense_of(tokens)
    t_count = int(uniq.numel())
    occurrences = torch.bincount(dense, minlength=t_count)
    # Presence: one entry per distinct (rollout, token) pair.
    pairs = _distinct(rollout * max(t_count, 1) + dense)
    pair_token, pair_rollout = pairs % max(t_count, 1), pairs // max(t_count, 1)
    pair_correct = (batch.rewards > 0)[pair_rollout]
    correct = torch.bincount(pair_token[pair_correct], minlength=t_count)
    wrong = torch.bincount(pair_token, minlength=t_count) - correct

    key_sum = torch.zeros(t_count, dtype=torch.float64, device=device)
    key_count = torch.zeros(t_count, dtype=torch.int64, device=device)
    history: HistoryUpdate | None = None
    ktae_params = spec.terms.get("ktae")
    if ktae_params is not None:
        tables = result.extras.get("ktae.tables")
        score = result.extras.get("ktae.score")
        if tables is None and batch.num_tokens == 0:
            tables = _empty_tables(device)
            score = torch.zeros(0, dtype=torch.float64, device=device)
        if tables is None or score is None:
            raise ValueError(
                "build_updates needs the KTAE tables: compute with "
                "TermContext(collect_ktae_tables=True)"
            )
        correct_g = (batch.rewards > ktae_params["correct_threshold"]).double()
        n_c = _segment_sum(batch.group_index, correct_g, batch.num_groups)
        n_w = batch.group_sizes.double() - n_c
        if prior is not None and wants_history(req):
            prior = prior.to(device)
            history = _history_update(batch, tables, prior, ktae_params)
            n_c, n_w = n_c + prior.n_c, n_w + prior.n_w
        # Key scores of the tables KTAE scored: groups with both correct and wrong rollouts.
        scored = ((n_c > 0) & (n_w > 0))[tables.group]
        table_dense = dense_of(tables.token[scored])
        key_sum.index_add_(0, table_dense, score[scored].double())
        key_count.index_add_(0, table_dense, torch.ones_like(table_dense))

    sens_sum = torch.zeros(t_count, dtype=torch.float64, device=device)
    sens_count = torch.zeros(t_count, dtype=torch.int64, device=device)
    cscr_params = spec.terms.get("cscr")
    if cscr_params is not None:
        s = sensitivity(batch, cscr_params["positive"], cscr_params["negative"])
        sens_sum.index_add_(0, dense, s)
        sens_count = occurrences.clone()

    def host(t: torch.Tensor) -> np.ndarray:
        return t.cpu().numpy()

    return StatsUpdate(
        history=history,
        tokens=TokenStatsUpdate(
            rollouts=batch.num_rollouts,
            tokens=host(uniq),
            correct=host(correct),
            wrong=host(wrong),
            occurrences=host(occurrences),
            key_sum=host(key_sum),
            key_count=host(key_count),
            sens_sum=host(sens_sum),
            sens_count=host(sens_count),
        ),
    )


# ---- reading the statistics back ------------------------------------------------------------


def token_stats_response(
    namespace: str,
    rollouts_counted: int,
    columns: dict[str, np.ndarray],
    order: str,
    limit: int,
) -> dict[str, Any]:
    """The ``GET /v1/stats/tokens`` body from per-token columns (each (T,), ``token_id``
    ascending): ``correct``, ``wrong``, ``occurrences``, ``key_sum``, ``key_count``,
    ``sens_sum``, ``sens_count``."""
    check_order(order)
    token = columns["token_id"]
    with np.errstate(divide="ignore", invalid="ignore"):
        key_score = np.where(
            columns["key_count"] > 0, columns["key_sum"] / columns["key_count"], np.nan
        )
        mean_sens = np.where(
            columns["sens_count"] > 0, columns["sens_sum"] / columns["sens_count"], np.nan
        )
    if order == "key":
        primary = np.abs(key_score)
    elif order == "sensitivity":
        primary = mean_sens
    else:
        primary = columns["occurrences"].astype(np.float64)
    missing = np.isnan(primary)
    # lexsort: last key first; missing values last, then descending, then token id ascending.
    ranked = np.lexsort((token, -np.nan_to_num(primary, nan=0.0), missing))[: max(0, limit)]
    rows = [
        {
            "token_id": int(token[i]),
            "correct_rollouts": int(columns["correct"][i]),
            "wrong_rollouts": int(columns["wrong"][i]),
            "occurrences": int(columns["occurrences"][i]),
            "key_score": None if np.isnan(key_score[i]) else float(key_score[i]),
            "mean_sensitivity": None if np.isnan(mean_sens[i]) else float(mean_sens[i]),
        }
        for i in ranked
    ]
    return {"namespace": namespace, "rollouts_counted": int(rollouts_counted), "tokens": rows}


def check_order(order: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"order must be one of {list(ORDERS)}, got {order!r}")


# ---- the interface ------------------------------------------------------------------------------

OnError = Callable[[str], None]
OnDuration = Callable[[str, float], None]
OnUp = Callable[[bool], None]


class StatsStore(Protocol):
    """KTAE history, vocabulary statistics and idempotency records, per namespace.

    Every method is safe to call while the backend is down: reads return None, writes False.
    """

    @property
    def status(self) -> StoreStatus:
        """``memory`` (embedded), ``up`` or ``down`` (Redis, as of the last operation)."""
        ...

    async def read_history(self, namespace: str, prompt_ids: Sequence[str]) -> HistoryPrior | None:
        """The prior of a batch whose groups have these prompt ids (tensors on the CPU;
        ``.to(device)`` them), zeros for prompts without history; None when the store is
        unreachable."""
        ...

    async def record(self, namespace: str, request_id: str | None, update: StatsUpdate) -> bool:
        """Apply ``update`` unless ``request_id`` was already counted in ``namespace``.

        ``request_id``: the client's id (None: no idempotency). True when this call counted the
        request; False when it was a duplicate or the store is unreachable.
        """
        ...

    async def token_stats(self, namespace: str, order: str, limit: int) -> dict[str, Any] | None:
        """The ``GET /v1/stats/tokens`` body; None when the store is unreachable."""
        ...

    async def ping(self) -> bool:
        """True when the store answers (a Redis store in backoff answers False at once)."""
        ...

    async def close(self) -> None: ...


__all__ = [
    "ORDERS",
    "HistoryPrior",
    "HistoryUpdate",
    "StatsStore",
    "StatsUpdate",
    "StoreStatus",
    "TokenStatsUpdate",
    "build_updates",
    "prompt_ids",
    "token_stats_response",
    "wants_history",
]
