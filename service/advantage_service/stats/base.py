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

1. ``query = history_query(req.batch, req.ignore_token_ids)`` (only when ``wants_history(req)``;
   tensor work: on a compute worker);
2. ``prior = await store.read_history(req.namespace, query)``: None means the store is down,
   ``summary.history = "unavailable"``; otherwise ``"applied"``;
3. compute with ``TermContext(ktae_prior=prior.to(device) if prior else None,
   collect_ktae_tables="ktae" in req.estimator.terms)``;
4. answer;
5. ``update = build_updates(req, result, prior)`` (tensor work: on a compute worker) and
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
from .blobs import TOKEN_DTYPE, VALUE_DTYPE, PromptHistory, TokenStatsUpdate, merge_history

# (group, token) keys pack the token id (< 2^31, see batch.INT32_LIMIT) into the low 32 bits.
TOKEN_BITS = 32

ORDERS = ("key", "sensitivity", "occurrences")
StoreStatus = Literal["memory", "up", "down"]


def wants_history(req: ComputeRequest) -> bool:
    """True when the request's KTAE term asked for per-prompt history."""
    ktae = req.estimator.terms.get("ktae")
    return ktae is not None and ktae["history"] != "none"


# ---- what a visit reads ---------------------------------------------------------------------


@dataclass
class HistoryQuery:
    """The (prompt, token id) pairs a request's KTAE looks up, grouped by prompt (CSR layout).

    ``prompt_ids``: G strings in the batch's group order; ``offsets``: int64 (G+1,);
    ``tokens``: int64 (K,), ascending within each prompt, prompt g owning
    ``tokens[offsets[g]:offsets[g + 1]]``.
    """

    prompt_ids: list[str]
    offsets: np.ndarray
    tokens: np.ndarray

    def tokens_of(self, g: int) -> np.ndarray:
        return self.tokens[self.offsets[g] : self.offsets[g + 1]]


def history_query(
    batch: RolloutBatch, ignore_token_ids: Sequence[int] | None = None
) -> HistoryQuery:
    """The distinct (group, token id) pairs of ``batch`` outside ``ignore_token_ids``: exactly
    the tables KTAE builds, so every lookup it makes is answered.

    Token ids are a vocabulary's, so the pairs are usually marked in a dense (group, token id)
    bitmap, whose nonzero positions come out sorted: no sort of the batch's tokens. Sparse ids
    (a bitmap much larger than the batch) fall back to one sort.
    """
    prompt_ids = list(batch.prompt_ids or batch.group_ids)
    if batch.tokens.device.type == "cpu":
        return _history_query_numpy(batch, ignore_token_ids, prompt_ids)
    return _history_query_torch(batch, ignore_token_ids, prompt_ids)


def _history_query_torch(
    batch: RolloutBatch, ignore_token_ids: Sequence[int] | None, prompt_ids: list[str]
) -> HistoryQuery:
    """``history_query`` on the batch's device (an accelerator)."""
    g_count = batch.num_groups
    tokens = batch.tokens.long()
    group = batch.group_index[batch.rollout_of_token]
    if ignore_token_ids:
        keep = ~torch.isin(tokens, torch.as_tensor(list(ignore_token_ids), device=tokens.device))
        tokens, group = tokens[keep], group[keep]
    vocab = int(tokens.max()) + 1 if tokens.numel() else 1
    if g_count * vocab <= max(8 * tokens.numel(), 1 << 16):
        present = torch.zeros(g_count * vocab, dtype=torch.bool, device=tokens.device)
        present[group * vocab + tokens] = True
        flat = torch.nonzero(present).squeeze(1)
        bounds = torch.arange(g_count + 1, device=flat.device) * vocab
        offsets = torch.searchsorted(flat, bounds)
        pair_tokens = flat % vocab
    else:
        keys = torch.unique((group << TOKEN_BITS) | tokens)
        counts = torch.bincount(keys >> TOKEN_BITS, minlength=g_count)
        offsets = torch.zeros(g_count + 1, dtype=torch.int64, device=counts.device)
        offsets[1:] = torch.cumsum(counts, 0)
        pair_tokens = keys & ((1 << TOKEN_BITS) - 1)
    return HistoryQuery(prompt_ids, offsets.cpu().numpy(), pair_tokens.cpu().numpy())


def _history_query_numpy(
    batch: RolloutBatch, ignore_token_ids: Sequence[int] | None, prompt_ids: list[str]
) -> HistoryQuery:
    """``history_query`` on the CPU: numpy's scatter and nonzero are ~3x torch's there."""
    tokens = batch.tokens.numpy()
    group = np.repeat(batch.group_index.numpy(), batch.lengths.numpy())
    if ignore_token_ids:
        keep = ~np.isin(tokens, np.asarray(list(ignore_token_ids), np.int64))
        tokens, group = tokens[keep], group[keep]
    g_count = batch.num_groups
    vocab = int(tokens.max()) + 1 if tokens.size else 1
    if g_count * vocab <= max(8 * tokens.size, 1 << 16):
        present = np.zeros(g_count * vocab, bool)
        present[group.astype(np.int64) * vocab + tokens] = True
        flat = np.flatnonzero(present)
        offsets = np.searchsorted(flat, np.arange(g_count + 1) * vocab)
        return HistoryQuery(prompt_ids, offsets, flat % vocab)
    keys = np.unique((group.astype(np.int64) << TOKEN_BITS) | tokens)
    offsets = np.searchsorted(keys >> TOKEN_BITS, np.arange(g_count + 1))
    return HistoryQuery(prompt_ids, offsets, keys & ((1 << TOKEN_BITS) - 1))


# ---- the prior KTAE merges -----------------------------------------------------------------


@dataclass
class HistoryPrior:
    """Decayed counts from earlier visits, in the form ``ktae()`` merges.

    ``n_c``, ``n_w``, ``len_c``, ``len_w``: float64 (G,) per group of the batch (0 for a group
    without history). ``keys``: int64 (K,) ascending, group << 32 | token id; ``values``:
    float64 (K, 4) a, b, occ_c, occ_w of each key. ``stored``: per group, the prompt's whole
    stored history as read (None: none), which the write merges into; it stays on the CPU.
    """

    n_c: torch.Tensor
    n_w: torch.Tensor
    len_c: torch.Tensor
    len_w: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    stored: list[PromptHistory | None] | None = None

    @property
    def num_groups(self) -> int:
        return int(self.n_c.numel())

    def to(self, device: torch.device | str) -> HistoryPrior:
        """The same prior with its tensors on ``device`` (the batch's)."""
        n_c, n_w, len_c, len_w, keys, values = (
            t.to(device, non_blocking=True)
            for t in (self.n_c, self.n_w, self.len_c, self.len_w, self.keys, self.values)
        )
        return HistoryPrior(n_c, n_w, len_c, len_w, keys, values, self.stored)

    def lookup(
        self, group: torch.Tensor, token: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prior a, b, occ_c, occ_w (float64 (M,) each) of (group, token id) pairs (int64 (M,)),
        zeros where there is none. One searchsorted over the sorted keys, none when the pairs
        are exactly the prior's keys (KTAE's tables of the query's batch)."""
        query = (group.long() << TOKEN_BITS) | token.long()
        if query.shape == self.keys.shape and torch.equal(query, self.keys):
            a, b, occ_c, occ_w = self.values.unbind(1)
            return a, b, occ_c, occ_w
        if self.keys.numel() == 0:
            zero = torch.zeros(query.shape, dtype=torch.float64, device=query.device)
            return zero, zero, zero, zero
        idx = torch.searchsorted(self.keys, query).clamp(max=self.keys.numel() - 1)
        found = self.keys[idx] == query
        values = torch.where(found[:, None], self.values[idx], torch.zeros_like(self.values[idx]))
        a, b, occ_c, occ_w = values.unbind(1)
        return a, b, occ_c, occ_w


def prior_from_stored(query: HistoryQuery, stored: Sequence[PromptHistory | None]) -> HistoryPrior:
    """The prior of ``query`` from each of its prompts' stored history (None: none): per prompt
    one searchsorted of the query's tokens in the stored token ids."""
    g_count = len(query.prompt_ids)
    totals = np.zeros((g_count, 4), np.float64)
    values = np.zeros((query.tokens.size, 4), np.float64)
    for g, history in enumerate(stored):
        if history is None:
            continue
        totals[g] = history.totals
        lo, hi = int(query.offsets[g]), int(query.offsets[g + 1])
        if hi == lo or not history.rows:
            continue
        want = query.tokens[lo:hi].astype(TOKEN_DTYPE)
        idx = np.searchsorted(history.tokens, want)
        np.minimum(idx, history.rows - 1, out=idx)
        block = values[lo:hi]
        block[...] = history.values[idx]
        block[history.tokens[idx] != want] = 0.0
        # a <= n_c etc. hold exactly; the clamp only removes the float32 rounding of stored
        # values, so the rounded Fisher table stays a valid table.
        np.minimum(block, history.totals, out=block)
    group = np.repeat(np.arange(g_count, dtype=np.int64), np.diff(query.offsets))
    totals_t = torch.from_numpy(totals)
    return HistoryPrior(
        n_c=totals_t[:, 0].clone(),
        n_w=totals_t[:, 1].clone(),
        len_c=totals_t[:, 2].clone(),
        len_w=totals_t[:, 3].clone(),
        keys=torch.from_numpy((group << TOKEN_BITS) | query.tokens.astype(np.int64, copy=False)),
        values=torch.from_numpy(values),
        stored=list(stored),
    )


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


def _stored_of(prior: HistoryPrior) -> list[PromptHistory | None]:
    """What the prior says is stored per group: its ``stored`` as read, else (a prior built by
    hand) its own keys and values."""
    if prior.stored is not None:
        return prior.stored
    keys = prior.keys.cpu().numpy()
    values = prior.values.cpu().numpy()
    totals = torch.stack([prior.n_c, prior.n_w, prior.len_c, prior.len_w], 1).cpu().numpy()
    bounds = np.searchsorted(keys >> TOKEN_BITS, np.arange(prior.num_groups + 1))
    return [
        PromptHistory(
            totals[g],
            (keys[lo:hi] & ((1 << TOKEN_BITS) - 1)).astype(TOKEN_DTYPE),
            values[lo:hi].astype(VALUE_DTYPE),
        )
        for g, (lo, hi) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True))
    ]


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
    stored = _stored_of(prior)
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
    return HistoryUpdate(prompt_ids=list(batch.prompt_ids or batch.group_ids), prompts=prompts)


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
    pairs = torch.unique(rollout * max(t_count, 1) + dense)
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

    async def read_history(self, namespace: str, query: HistoryQuery) -> HistoryPrior | None:
        """The prior for the query's prompts (tensors on the CPU; ``.to(device)`` them), zeros
        for prompts without history; None when the store is unreachable."""
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
    "HistoryQuery",
    "HistoryUpdate",
    "StatsStore",
    "StatsUpdate",
    "StoreStatus",
    "TokenStatsUpdate",
    "build_updates",
    "history_query",
    "prior_from_stored",
    "token_stats_response",
    "wants_history",
]
