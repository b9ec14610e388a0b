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

A claim keeps the *digest* of the request that made it (:attr:`RequestWrite.digest`: a hash of
what the request contributes, ``advantage_service.term_state.request_digest``). A later write of
the same id with the same digest is a retry (``duplicate``); with another digest it is another
request under a reused id (``conflict``): not counted either, but told apart. A claim without a
digest (written by an earlier release, or a write that gave none) matches any digest: it is
taken for a retry. :meth:`StatsStore.read_partly` reads a request id's claim along with the
records, so that the service can refuse a conflicting request before it answers.

The service's writer coalesces the writes of many requests into one update per namespace
(:meth:`StatsStore.record_requests`), so each request is still counted exactly once. The store
keeps bytes and never folds: where it applied nothing for some requests, it names the records
to fold again without them (:class:`FoldAgain`), the writer folds them and sends them
(:class:`Recording`), and the store writes on (:mod:`.write_groups`):

- a store that applies a write whole (in memory, one Redis: :meth:`StatsStore.record_many`)
  claims every request id of the update together with it, or none of them and nothing at all
  when one was already claimed; the write goes on without those requests, their records
  folded again;
- a store that writes in parts (a Redis Cluster: one part per hash slot) claims and applies each
  part atomically on its own: a request id is counted once *per part*. A part where one of its
  ids was counted before applies nothing and goes again without those requests, folded again;
  the other parts apply, so a resend completes the parts an earlier write left missing and
  repeats none. A request's statistics are written only once every part of its records is, and
  it is ``counted`` by the write whose statistics part claimed it.

Poisoned writes
---------------
A request whose write the store cannot take (a key or request id that is not valid Unicode text,
a record larger than the store holds, a staged record the Redis commit script finds missing)
must cost no other request its statistics. Such a write is refused whole, with nothing applied
(:class:`Refused`; the Redis scripts check everything that can fail before their first write),
and the write goes again in halves, each half's records folded again on top of what was
written before it, until the requests the store refuses are alone: those are ``poisoned`` (not
counted), every other one is counted once. A failure that may have applied part of a write
(Redis unreachable mid-write) is never split: its requests are ``lost``, as before.

The order of calls per request (read, compute, answer, then write) has one owner:
``advantage_service.term_state.StateSession``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

import numpy as np

from .blobs import TokenStatsUpdate, token_columns

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
POISONED: Final = "poisoned"  # refused by the store on its own (see "Poisoned writes"): not counted
CONFLICT: Final = "conflict"  # its request id was counted before for another body: not counted
Outcome = Literal["counted", "duplicate", "lost", "poisoned", "conflict"]


class Refused(Exception):
    """The store refused a write as a whole and applied nothing of it: a key or request id it
    cannot encode, or a record it cannot take. The same requests written in smaller groups may
    go through (see "Poisoned writes")."""


@dataclass
class StatsUpdate:
    """Everything one request writes: records ((key space, key) -> bytes) and its vocabulary
    statistics increments."""

    records: dict[RecordKey, bytes]
    tokens: TokenStatsUpdate


@dataclass(frozen=True)
class Read:
    """What a read of records gave: ``records`` in the order of the keys (None for a key
    without one, or not read), the positions of the keys that could not be read (a part of
    a Redis Cluster that did not answer), and what the claim of a request id holds."""

    records: list[bytes | None]
    unread: frozenset[int] = frozenset()
    # The digest kept with the claim of the request id the read was asked about; None when it
    # was not claimed, its claim has no digest (an earlier release's), or it was not read.
    claimed_digest: str | None = None


@dataclass(frozen=True)
class RequestWrite:
    """One request's share of a coalesced write: the client's ``request_id`` (None: no
    idempotency), the record ``keys`` it writes (its visits are folded into the update's
    records), its vocabulary statistics ``tokens`` and the ``digest`` its claim keeps (None:
    none; a claim without one matches any)."""

    request_id: str | None
    keys: tuple[RecordKey, ...]
    tokens: TokenStatsUpdate
    digest: str | None = None


@dataclass(frozen=True)
class Write:
    """A write of several requests as a store hands it on (to its layout, to its groups):
    ``update``, the folded writes of ``requests`` (in that order), to ``namespace``;
    ``together``: the requests go together or not at all (:meth:`StatsStore.record_many`),
    none written again without the others."""

    namespace: str
    requests: Sequence[RequestWrite]
    update: StatsUpdate
    together: bool = False


@dataclass(frozen=True)
class Claims:
    """What a whole write found claimed before, as positions among its requests: ids counted
    before for the same body (``duplicates``) or for another one (``conflicts``). Nothing was
    applied or claimed when it found any (it is then true)."""

    duplicates: tuple[int, ...] = ()
    conflicts: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.duplicates or self.conflicts)


@dataclass(frozen=True)
class FoldAgain:
    """Records a write needs folded again (:attr:`Recording.again`): those of ``keys`` from the
    visits of the requests of the write at positions ``keep`` (ascending: the order they were
    answered in); a key none of them wrote is left out."""

    keys: frozenset[RecordKey]
    keep: tuple[int, ...]


class Recording(Protocol):
    """A write of several requests under way (:meth:`StatsStore.record_requests`)."""

    @property
    def again(self) -> Sequence[FoldAgain]:
        """The records to fold again and :meth:`send` before the write can go on; empty once
        it is over (:attr:`outcomes` final)."""
        ...

    @property
    def outcomes(self) -> list[Outcome]:
        """What became of each request (final once :attr:`again` is empty)."""
        ...

    async def send(self, records: Mapping[RecordKey, bytes]) -> None:
        """Write on with ``records``, those :attr:`again` asked for, folded."""
        ...


def digests_differ(stored: str | None, digest: str | None) -> bool:
    """True when a claim's ``stored`` digest proves that a request of ``digest`` is another
    request under the same id (a claim or a request without a digest proves nothing)."""
    return bool(stored) and bool(digest) and stored != digest


def unstorable(namespace: str, request_id: str | None, keys: Iterable[RecordKey]) -> str | None:
    """Why no store can take a request's write, checked on its own before it is folded with
    others: the first of its namespace, request id and record keys that is not valid Unicode
    text (a lone surrogate, which no store key can encode); None when every one is."""
    named: list[tuple[str, str | None]] = [("namespace", namespace), ("request_id", request_id)]
    for what, text in itertools.chain(named, (("record key", f"{s}:{k}") for s, k in keys)):
        if text is None:
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return f"its {what} is not valid Unicode text (a lone surrogate)"
    return None


# ---- reading the statistics back ------------------------------------------------------------


async def ranked_token_stats(
    namespace: str, table: TokenStatsUpdate, order: str, limit: int
) -> dict[str, Any]:
    """:func:`token_stats_response` of ``table``, on a worker thread: ranking a vocabulary's
    worth of ids takes 12-18 ms, which on the event loop would hold back every other client's
    request at each ``GET /v1/stats/tokens`` (the table is never changed in place: a write
    replaces it)."""
    columns = token_columns(table)
    return await asyncio.to_thread(
        token_stats_response, namespace, table.rollouts, columns, order, limit
    )


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
    A store that subclasses this interface writes through :meth:`record_write`, of which
    :meth:`record`, :meth:`record_many` and :meth:`record_requests` are forms.
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

    async def read_partly(
        self, namespace: str, keys: Sequence[RecordKey], request_id: str | None = None
    ) -> Read | None:
        """:meth:`read_records`, answering what could be read when only part of the store
        answers (a Redis Cluster with a master down); None when nothing could be read. With
        ``request_id``, the digest its claim keeps is read in the same round trip
        (:attr:`Read.claimed_digest`)."""
        ...

    async def record(self, namespace: str, request_id: str | None, update: StatsUpdate) -> bool:
        """Apply ``update`` unless ``request_id`` was already counted in ``namespace``.

        ``request_id``: the client's id (None: no idempotency). True when this call counted the
        request; False when it was a duplicate or the store is unreachable.
        """
        ids = [] if request_id is None else [request_id]
        try:
            return await self.record_many(namespace, ids, update) == []
        except Refused:
            return False

    async def record_many(
        self, namespace: str, request_ids: Sequence[str], update: StatsUpdate
    ) -> list[str] | None:
        """Apply ``update``, the combined writes of several requests, and claim every one of
        their ``request_ids`` (those the clients sent), atomically.

        ``[]``: applied and claimed. When some of ``request_ids`` were already claimed in
        ``namespace``, nothing is applied or claimed and the answer lists those ids (the caller
        writes again without their requests). None when the store is unreachable. Raises
        :class:`Refused` (nothing applied) for a write the store cannot take. (A store that
        writes in parts, a Redis Cluster, takes at most one request id here: several requests
        go through :meth:`record_requests`.)
        """
        requests = requests_together(request_ids, update)
        recording = await self.record_write(Write(namespace, requests, update, together=True))
        return claimed_together(requests, recording.outcomes)

    async def record_requests(
        self, namespace: str, requests: Sequence[RequestWrite], update: StatsUpdate
    ) -> Recording:
        """Write ``update``, the folded writes of ``requests`` (in that order), each request
        counted once under its id (see the module's docstring). Where the store applied nothing
        for some of the requests (claimed before, or a write it refused whole), the write asks
        for the records folded again without them (:attr:`Recording.again`) and goes on once
        they are sent; then :attr:`Recording.outcomes` says what became of each request.
        Requests the store cannot take are ``poisoned`` alone; no exception for them."""
        return await self.record_write(Write(namespace, requests, update))

    async def record_write(self, write: Write) -> Recording:
        """:meth:`record_requests` of ``write``'s requests, together or not at all where it says
        so (:meth:`record_many`: none written again without the others)."""
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


def requests_together(request_ids: Sequence[str], update: StatsUpdate) -> list[RequestWrite]:
    """The requests of :meth:`StatsStore.record_many`, which go together or not at all: one per
    id (one without an id when none is given), each writing the whole ``update``."""
    keys = tuple(update.records)
    ids = list(dict.fromkeys(request_ids))
    return [RequestWrite(rid, keys, update.tokens) for rid in ids] or [
        RequestWrite(None, keys, update.tokens)
    ]


def claimed_together(
    requests: Sequence[RequestWrite], outcomes: Sequence[Outcome]
) -> list[str] | None:
    """:meth:`StatsStore.record_many`'s answer from what became of its requests (written
    together): the ids claimed before; None when the store was not reached; raises
    :class:`Refused` when it refused the write."""
    if POISONED in outcomes:
        raise Refused("the store refused the write")
    claimed = [
        rid
        for r, outcome in zip(requests, outcomes, strict=True)
        if outcome in (DUPLICATE, CONFLICT) and (rid := r.request_id) is not None
    ]
    if claimed:
        return claimed
    return None if LOST in outcomes else []


__all__ = [
    "CONFLICT",
    "COUNTED",
    "DUPLICATE",
    "LOST",
    "ORDERS",
    "POISONED",
    "Claims",
    "FoldAgain",
    "OnDuration",
    "OnError",
    "OnUp",
    "Outcome",
    "Read",
    "RecordKey",
    "Recording",
    "Refused",
    "RequestWrite",
    "StatsStore",
    "StatsUpdate",
    "StoreStatus",
    "Write",
    "check_order",
    "claimed_together",
    "digests_differ",
    "ranked_token_stats",
    "requests_together",
    "token_stats_response",
    "unstorable",
]
