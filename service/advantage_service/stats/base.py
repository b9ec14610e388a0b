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
(:meth:`StatsStore.record_requests`), so each request is still counted exactly once:

- a store that applies a write whole (in memory, one Redis: :meth:`StatsStore.record_many`)
  claims every request id of the update together with it, or none of them and nothing at all
  when one was already claimed; :func:`record_whole` then leaves those requests out, folds the
  rest again and writes them;
- a store that writes in parts (a Redis Cluster: one part per hash slot) claims and applies each
  part atomically on its own: a request id is counted once *per part*. A part where one of its
  ids was counted before applies nothing and is folded again without those requests; the
  other parts apply, so a resend completes the parts an earlier write left missing and repeats
  none. A request's statistics are written only once every part of its records is, and it is
  ``counted`` by the write whose statistics part claimed it.

The order of calls per request (read, compute, answer, then write) has one owner:
``advantage_service.term_state.StateSession``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

import numpy as np

from .blobs import TokenStatsUpdate, merge_token_stats

ORDERS = ("key", "sensitivity", "occurrences")
# degraded: a Redis Cluster of which some masters answer and some do not (their slots' history
# and statistics are unavailable, the rest is served).
StoreStatus = Literal["memory", "up", "degraded", "down"]
# (key space, key) of a record.
RecordKey = tuple[str, str]

# What became of a request's writes (record_requests).
COUNTED: Final = "counted"  # written, and its statistics counted by this write
DUPLICATE: Final = "duplicate"  # its request id's statistics were counted before: not again
LOST: Final = "lost"  # not (completely) written: the store, or a part of it, was unreachable
Outcome = Literal["counted", "duplicate", "lost"]


@dataclass
class StatsUpdate:
    """Everything one request writes: records ((key space, key) -> bytes) and its vocabulary
    statistics increments."""

    records: dict[RecordKey, bytes]
    tokens: TokenStatsUpdate


@dataclass(frozen=True)
class Read:
    """What a read of records gave: ``records`` in the order of the keys (None for a key
    without one, or not read), and the positions of the keys that could not be read (a part of
    a Redis Cluster that did not answer)."""

    records: list[bytes | None]
    unread: frozenset[int] = frozenset()


@dataclass(frozen=True)
class RequestWrite:
    """One request's share of a coalesced write: the client's ``request_id`` (None: no
    idempotency), the record ``keys`` it writes (its visits are folded into the update's
    records) and its vocabulary statistics ``tokens``."""

    request_id: str | None
    keys: tuple[RecordKey, ...]
    tokens: TokenStatsUpdate


# refold(keys, without): the records of ``keys`` folded again from the visits of every request
# of the write except those whose id is in ``without`` (a key only they wrote is left out).
Refold = Callable[[Collection[RecordKey], Collection[str]], Awaitable[dict[RecordKey, bytes]]]


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
        """``memory`` (embedded), ``up``, ``degraded`` (part of a Redis Cluster unreachable)
        or ``down`` (Redis, as of the last operations)."""
        ...

    async def read_records(
        self, namespace: str, keys: Sequence[RecordKey]
    ) -> list[bytes | None] | None:
        """The records of ``keys`` in order (None for a key without one); None when the store is
        unreachable."""
        ...

    async def read_partly(self, namespace: str, keys: Sequence[RecordKey]) -> Read | None:
        """:meth:`read_records`, answering what could be read when only part of the store
        answers (a Redis Cluster with a master down); None when nothing could be read."""
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
        writes again without their requests). None when the store is unreachable. (A store
        that writes in parts, a Redis Cluster, takes at most one request id here: several
        requests go through :meth:`record_requests`.)
        """
        ...

    async def record_requests(
        self,
        namespace: str,
        requests: Sequence[RequestWrite],
        update: StatsUpdate,
        refold: Refold,
    ) -> list[Outcome]:
        """Write ``update``, the folded writes of ``requests`` (in that order), each request
        counted once under its id: what became of each request (see the module's docstring).
        ``refold`` folds the records again without requests counted before."""
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


class WholeWrites(Protocol):
    async def record_many(
        self, namespace: str, request_ids: Sequence[str], update: StatsUpdate
    ) -> list[str] | None: ...


async def record_whole(
    store: WholeWrites,
    namespace: str,
    requests: Sequence[RequestWrite],
    update: StatsUpdate,
    refold: Refold,
) -> list[Outcome]:
    """:meth:`StatsStore.record_requests` for a store that applies a write whole: the update
    with every request id, again without the requests whose ids were counted before (folded
    again), until it is written (each try leaves one out at least)."""
    outcomes: list[Outcome] = [LOST] * len(requests)
    left = list(range(len(requests)))
    while True:
        ids = [rid for i in left if (rid := requests[i].request_id) is not None]
        claimed = await store.record_many(namespace, ids, update)
        if claimed is None:
            return outcomes
        if not claimed:
            for i in left:
                outcomes[i] = COUNTED
            return outcomes
        before = set(claimed)
        rest = [i for i in left if requests[i].request_id not in before]
        if not rest or len(rest) == len(left):
            # (nothing left to write, or a store that answers ids it was not given)
            for i in left:
                if requests[i].request_id in before:
                    outcomes[i] = DUPLICATE
            return outcomes
        for i in left:
            if requests[i].request_id in before:
                outcomes[i] = DUPLICATE
        left = rest
        kept = set(rest)
        without = {
            r.request_id
            for i, r in enumerate(requests)
            if i not in kept and r.request_id is not None
        }
        keys = {key for i in rest for key in requests[i].keys}
        records = await refold(keys, without)
        update = StatsUpdate(records, merge_token_stats([requests[i].tokens for i in rest]))


__all__ = [
    "COUNTED",
    "DUPLICATE",
    "LOST",
    "ORDERS",
    "OnDuration",
    "OnError",
    "OnUp",
    "Outcome",
    "Read",
    "RecordKey",
    "Refold",
    "RequestWrite",
    "StatsStore",
    "StatsUpdate",
    "StoreStatus",
    "WholeWrites",
    "check_order",
    "record_whole",
    "token_stats_response",
]
