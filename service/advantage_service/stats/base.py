"""The stats store's semantics (records, vocabulary statistics, idempotency) and its interface.

The store knows no estimator: it keeps what the terms that keep state hand it (see
``advantage_service.estimators.state``).

Records (per namespace)
-----------------------
Opaque bytes under (key space, key): a term's key space is its own (e.g. ``history``, keyed by
prompt id); the store never looks inside. A request reads the records of its keys in one round
trip and writes the new ones after its answer.

Vocabulary statistics (per namespace, every request)
----------------------------------------------------
Per token id, column sums (:mod:`.blobs`, ``TOKEN_COLUMNS``): ``correct`` / ``wrong`` (rollouts
containing it with reward > 0 / <= 0; presence, not counts) and ``occurrences``, counted for
every request, and the columns terms fill: ``key_sum`` / ``key_count`` (the key-token score summed
over the (group, token) tables the key-token term scored, and their count: ``key_score`` is the
mean) and ``sens_sum`` / ``sens_count`` (the counterfactual sensitivity summed over the token's
occurrences, and their count: ``mean_sensitivity``). Plus ``rollouts_counted``. Orders: ``key``
= |key_score| descending (strong evidence either way first; the sign says which way),
``sensitivity`` = mean_sensitivity descending, ``occurrences`` descending; tokens without a value
for the order come last, ties go to the lower token id.

Every stored entry expires ``ttl_seconds`` (``ADV_STATS_TTL_SECONDS``) after its last write.

Idempotency
-----------
A request whose client sent ``request_id`` is counted at most once per namespace for the TTL:
the store's first write claims the id, and writes of a request that did not claim it are skipped
(records and statistics unchanged). The request itself is still computed and answered.

The service's writer coalesces the writes of many requests into one update per namespace
(:meth:`StatsStore.record_many`): it claims every request id of the update together with it, or
none of them and nothing at all when one was already claimed (the writer then leaves those
requests out and writes the rest), so each request is still counted exactly once.

The order of calls per request (read, compute, answer, then write) has one owner:
``advantage_service.term_state.StateSession``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

from .blobs import TokenStatsUpdate

ORDERS = ("key", "sensitivity", "occurrences")
StoreStatus = Literal["memory", "up", "down"]
# (key space, key) of a record.
RecordKey = tuple[str, str]


@dataclass
class StatsUpdate:
    """Everything one request writes: records ((key space, key) -> bytes) and its vocabulary
    statistics increments."""

    records: dict[RecordKey, bytes]
    tokens: TokenStatsUpdate


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
    """Records, vocabulary statistics and idempotency claims, per namespace.

    Every method is safe to call while the backend is down: reads return None, writes False.
    """

    @property
    def status(self) -> StoreStatus:
        """``memory`` (embedded), ``up`` or ``down`` (Redis, as of the last operation)."""
        ...

    async def read_records(
        self, namespace: str, keys: Sequence[RecordKey]
    ) -> list[bytes | None] | None:
        """The records of ``keys`` in order (None for a key without one); None when the store is
        unreachable."""
        ...

    async def record(self, namespace: str, request_id: str | None, update: StatsUpdate) -> bool:
        """Apply ``update`` unless ``request_id`` was already counted in ``namespace``.

        ``request_id``: the client's id (None: no idempotency). True when this call counted the
        request; False when it was a duplicate or the store is unreachable.
        """
        ...

    async def record_many(
        self, namespace: str, request_ids: Sequence[str], update: StatsUpdate
    ) -> list[str] | None:
        """Apply ``update``, the combined writes of several requests, and claim every one of
        their ``request_ids`` (those the clients sent), atomically.

        ``[]``: applied and claimed. When some of ``request_ids`` were already claimed in
        ``namespace``, nothing is applied or claimed and the answer lists those ids (the caller
        writes again without their requests). None when the store is unreachable.
        """
        ...

    @property
    def writable(self) -> bool:
        """False while a write would not even be attempted (the store is known to be
        unreachable: Redis in its backoff after a failure)."""
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
    "RecordKey",
    "StatsStore",
    "StatsUpdate",
    "StoreStatus",
    "check_order",
    "token_stats_response",
]
