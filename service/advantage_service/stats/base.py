"""The stats store's semantics (history, vocabulary statistics, idempotency) and its interface.

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
from typing import Any, Literal, Protocol

import numpy as np

from .prior import HistoryPrior
from .updates import StatsUpdate

ORDERS = ("key", "sensitivity", "occurrences")
StoreStatus = Literal["memory", "up", "down"]


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
    "OnDuration",
    "OnError",
    "OnUp",
    "StatsStore",
    "StoreStatus",
    "check_order",
    "token_stats_response",
]
