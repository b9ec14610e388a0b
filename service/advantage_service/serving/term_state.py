"""The engine's side of the stateful-term protocol (``estimators.state``): reads, writes and the
one order of a request's store calls.

Per request, a :class:`StateSession`:

1. starts reading, in one store call, the records of every enabled term that keeps state and
   has keys for this batch, and at once gives the computation its :attr:`~StateSession.context`:
   each such term finds its prior there (``ctx.read``), still in flight, and waits for it only
   where it needs it (the read overlaps the computation). The records are decoded into the
   term's prior on a worker thread, on the computation's device;
2. the request is computed with that context and answered;
3. :meth:`~StateSession.settle` says what the read gave (the summary's ``history``: ``none``,
   ``applied``, ``empty``, ``partial`` or ``unavailable``; per group,
   :meth:`~StateSession.group_history`). Keys the store could not read (part of a Redis Cluster
   down) count as a first visit and are not written: their stored records stay as they are;
4. :meth:`~StateSession.writes` (tensor work: run it on a worker) builds what the request
   writes: each term's records (only where its read succeeded; a term that folds gives its
   visit values) and the vocabulary statistics (counted for every request, plus the columns
   terms fill). After the answer the writer folds the writes of the requests that wait together
   (:func:`fold_writes`: one record per key, the statistics summed) and hands them to the store
   in one call per namespace. :meth:`~StateSession.update` and :meth:`~StateSession.record` are
   the same for one request alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..batch import RolloutBatch
from ..estimators import TERMS, AdvantageResult, TermContext
from ..estimators.state import PendingRead, TermState, WriteOptions
from ..stats import StatsStore, StatsUpdate, TokenStatsUpdate
from ..stats.base import RecordKey
from ..stats.blobs import COUNT_COLUMNS, INT32_MAX, TOKEN_COLUMNS, merge_token_stats
from ..wire.request import ComputeRequest

# Counted for every request; the other statistics columns are the terms' to fill.
BASE_COLUMNS = ("correct", "wrong", "occurrences")


def stateful_terms(req: ComputeRequest) -> dict[str, tuple[TermState[Any], Mapping[str, Any]]]:
    """The request's enabled terms that keep state: name -> (their state, their parameters)."""
    out: dict[str, tuple[TermState[Any], Mapping[str, Any]]] = {}
    for name, params in req.estimator.terms.items():
        state = TERMS[name].state
        if state is not None:
            out[name] = (state, params)
    return out


def read_keys(req: ComputeRequest) -> dict[str, list[str]]:
    """Term name -> the record keys it reads for this request (terms that read nothing left out)."""
    keys = {}
    for name, (state, params) in stateful_terms(req).items():
        wanted = state.read_keys(req.batch, params)
        if wanted:
            keys[name] = wanted
    return keys


def reads_state(req: ComputeRequest) -> bool:
    """True when computing the request reads state from the store (history)."""
    return bool(read_keys(req))


@dataclass
class PendingWrites:
    """What one request writes, before it is folded with other requests' writes.

    ``request_id``: the client's id (None when the client sent none: no idempotency);
    ``records``: (key space, key) -> what the term wrote for this visit (its visit value when
    it folds, else the bytes); ``tokens``: the request's vocabulary statistics."""

    namespace: str
    request_id: str | None
    records: dict[RecordKey, Any]
    tokens: TokenStatsUpdate


def _spaces() -> dict[str, TermState[Any]]:
    """Key space -> the state of the term that owns it."""
    return {
        term.state.space: term.state
        for term in TERMS.values()
        if term.state is not None and term.state.space is not None
    }


def fold_writes(writes: Sequence[PendingWrites], options: WriteOptions) -> StatsUpdate:
    """One update with what ``writes`` (in the order they were answered) would leave written
    one after the other: each key's visits folded in order by its term (one record per key),
    the vocabulary statistics summed. Tensor work: run it on a worker."""
    return StatsUpdate(
        records=fold_records(writes, options),
        tokens=merge_token_stats([w.tokens for w in writes]),
    )


def fold_records(
    writes: Sequence[PendingWrites],
    options: WriteOptions,
    keys: Collection[RecordKey] | None = None,
) -> dict[RecordKey, bytes]:
    """The records of :func:`fold_writes`, only those of ``keys`` when given (a store folds
    again the keys of one part of a write without the requests counted before)."""
    visits: dict[RecordKey, list[Any]] = {}
    for write in writes:
        for key, visit in write.records.items():
            if keys is None or key in keys:
                visits.setdefault(key, []).append(visit)
    spaces = _spaces()
    return {key: spaces[key[0]].record_bytes(seen, options) for key, seen in visits.items()}


class StateSession:
    """One request's reads and writes of the terms that keep state. Make it on the event loop
    (it starts the read at once); see the module's docstring for the order of the calls."""

    def __init__(
        self,
        store: StatsStore,
        req: ComputeRequest,
        device: torch.device,
        options: WriteOptions | None = None,
    ) -> None:
        self.store = store
        self.req = req
        self.device = device
        self.options = options or WriteOptions()
        self._keys = read_keys(req)
        self._reads: dict[str, PendingRead[Any]] = {name: PendingRead() for name in self._keys}
        self._priors: dict[str, Any] = {}
        # What the read found: per term, whether each of its keys had a record; the keys that
        # could not be read.
        self._found: dict[str, list[bool]] = {}
        self._unread: set[RecordKey] = set()
        self._task: asyncio.Task[bool] | None = None
        if self._keys:
            self._task = asyncio.get_running_loop().create_task(self._read())
            self._task.add_done_callback(self._abandoned)
        self.context = TermContext(reads=dict(self._reads))

    async def _read(self) -> bool:
        """Read every term's records in one call and decode each term's prior; True when the
        store answered."""
        spaces = {name: TERMS[name].state for name in self._keys}
        keys: list[RecordKey] = [
            (state.space, key)
            for name, state in spaces.items()
            if state is not None and state.space is not None
            for key in self._keys[name]
        ]
        read = await self.store.read_partly(self.req.namespace, keys)
        if read is None:
            for pending in self._reads.values():
                pending.resolve(None)
            return False
        records = read.records
        # Keys on a part of the store that did not answer: computed as a first visit, never
        # written (the record is still there, unread).
        self._unread = {keys[i] for i in read.unread}
        start = 0
        for name, state in spaces.items():
            assert state is not None and state.decode is not None
            mine = records[start : start + len(self._keys[name])]
            self._found[name] = [record is not None for record in mine]
            start += len(mine)
            try:
                prior = await asyncio.to_thread(state.decode, mine, self.device)
            except Exception as exc:  # (e.g. it could not be moved to the device)
                self._reads[name].fail(exc)
                continue
            self._priors[name] = prior
            self._reads[name].resolve(prior)
        return True

    def _abandoned(self, task: asyncio.Task[bool]) -> None:
        # A cancelled or failed read resolves every prior to None: no computation waits forever.
        if task.cancelled() or task.exception() is not None:
            for read in self._reads.values():
                read.resolve(None)

    def cancel(self) -> None:
        """Abandon a read still in flight (the request ended without it)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def settle(self) -> str:
        """Wait for the read: the summary's ``history``. ``none``: nothing to read;
        ``unavailable``: the store could not be read; ``partial``: some groups' records could
        not be read (part of a Redis Cluster did not answer) and the others' were;
        ``applied``: earlier requests contributed to at least one group; ``empty``: the read
        succeeded and no group had anything stored (a prompt's first visit, or after its
        history expired)."""
        if self._task is None:
            return "none"
        try:
            answered = await self._task
        except Exception:
            answered = False
        if not answered or len(self._priors) < len(self._keys):
            return "unavailable"
        if self._unread:
            return "partial"
        for name, prior in self._priors.items():
            state = TERMS[name].state
            if state is None or state.contributed is None or state.contributed(prior):
                return "applied"
        return "empty"

    def group_history(self, history: str) -> list[str] | None:
        """Per group, what its history read gave (call after :meth:`settle`, which answered
        ``history``): ``applied`` (a record was found), ``empty`` or ``unavailable``; None when
        the request reads no history, or its terms' keys are not one per group."""
        groups = self.req.batch.num_groups
        per_group = {name: keys for name, keys in self._keys.items() if len(keys) == groups}
        if history == "none" or not per_group:
            return None
        if history == "unavailable":
            return ["unavailable"] * groups
        out = []
        for g in range(groups):
            unread = found = False
            for name, keys in per_group.items():
                state = TERMS[name].state
                assert state is not None and state.space is not None
                unread |= (state.space, keys[g]) in self._unread
                found |= self._found.get(name, [False] * groups)[g]
            out.append("unavailable" if unread else "applied" if found else "empty")
        return out

    def update(self, result: AdvantageResult) -> StatsUpdate:
        """What the request alone writes (call after :meth:`settle`): the records of the terms
        whose read succeeded and the request's vocabulary statistics."""
        return fold_writes([self.writes(result)], self.options)

    def writes(self, result: AdvantageResult) -> PendingWrites:
        """What the request writes, to be folded with other requests' (call after
        :meth:`settle`)."""
        batch = self.req.batch
        records: dict[RecordKey, Any] = {}
        columns: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for name, (state, params) in stateful_terms(self.req).items():
            prior = self._priors.get(name)
            writes = state.writes(batch, params, result.state.get(name), prior, self.options)
            if writes.records:
                if prior is None or state.space is None:
                    raise ValueError(f"term {name!r} wrote records without a prior read")
                space = state.space
                records.update(
                    {
                        (space, k): v
                        for k, v in writes.records.items()
                        if (space, k) not in self._unread
                    }
                )
            for column, values in writes.columns.items():
                if (
                    column not in state.columns
                    or column not in TOKEN_COLUMNS
                    or (column in BASE_COLUMNS)
                ):
                    raise ValueError(f"term {name!r} wrote an undeclared column {column!r}")
                columns.setdefault(column, []).append(values)
        req = self.req
        return PendingWrites(
            namespace=req.namespace,
            request_id=req.request_id if req.client_request_id else None,
            records=records,
            tokens=token_statistics(batch, columns),
        )

    async def record(self, update: StatsUpdate) -> bool:
        """Hand ``update`` to the store (idempotent under the client's request id)."""
        req = self.req
        request_id = req.request_id if req.client_request_id else None
        return await self.store.record(req.namespace, request_id, update)


# ---- vocabulary statistics ----------------------------------------------------------------------


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
    uniq = _distinct(tokens)
    return uniq, lambda t: torch.searchsorted(uniq, t)


def token_statistics(
    batch: RolloutBatch, columns: Mapping[str, list[tuple[torch.Tensor, torch.Tensor]]]
) -> TokenStatsUpdate:
    """A request's vocabulary statistics: per distinct token id, the rollouts containing it with
    reward > 0 and <= 0 (presence) and its occurrences, plus the terms' ``columns`` (name ->
    (token ids, values) pairs, summed per token id). On the CPU, vectorised over the batch."""
    batch = batch.to("cpu")
    tokens = batch.tokens.long()
    rollout = batch.rollout_of_token
    uniq, dense_of = _distinct_tokens(tokens)
    t_count = int(uniq.numel())
    occurrences = torch.bincount(dense_of(tokens), minlength=t_count)
    # Presence: one entry per distinct (rollout, token) pair.
    pairs = _distinct(rollout * max(t_count, 1) + dense_of(tokens))
    pair_token, pair_rollout = pairs % max(t_count, 1), pairs // max(t_count, 1)
    pair_correct = (batch.rewards > 0)[pair_rollout]
    correct = torch.bincount(pair_token[pair_correct], minlength=t_count)
    wrong = torch.bincount(pair_token, minlength=t_count) - correct
    sums = {"correct": correct.numpy(), "wrong": wrong.numpy(), "occurrences": occurrences.numpy()}
    for name in TOKEN_COLUMNS:
        if name in BASE_COLUMNS:
            continue
        total = torch.zeros(t_count, dtype=torch.int64 if name in COUNT_COLUMNS else torch.float64)
        for ids, values in columns.get(name, []):
            total.index_add_(0, dense_of(ids.to("cpu").long()), values.to("cpu", total.dtype))
        sums[name] = total.numpy()
    return TokenStatsUpdate(rollouts=batch.num_rollouts, tokens=uniq.numpy(), **sums)


__all__ = [
    "PendingWrites",
    "StateSession",
    "fold_records",
    "fold_writes",
    "read_keys",
    "reads_state",
    "stateful_terms",
    "token_statistics",
]
