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

A request whose client sent ``request_id`` also has a digest (:func:`request_digest`: what it
contributes), computed on a worker thread while it computes, and the session reads the digest
its id's claim keeps in the same store call as the records (one more ``GET`` in the read's
pipeline; a request that reads no records makes that call alone, also while it computes).
:meth:`~StateSession.check_request_id` then refuses (409 ``conflict``) a request whose id was
counted before for another body. The check never fails a request on its own: a store that
cannot be read, or a claim without a digest (an earlier release's), is no conflict. A request
without ``request_id`` costs nothing of this.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash
from advantage_contract.fields import TOKEN_FIELDS

from ..batch import RolloutBatch
from ..errors import RequestError, shown
from ..estimators import TERMS, AdvantageResult, TermContext
from ..estimators.state import PendingRead, TermState, TokenCounts, WriteOptions
from ..stats import StatsStore, StatsUpdate, TokenStatsUpdate
from ..stats.base import RecordKey, digests_differ
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
    it folds, else the bytes); ``tokens``: the request's vocabulary statistics; ``digest``:
    :func:`request_digest` (None without a request id)."""

    namespace: str
    request_id: str | None
    records: dict[RecordKey, Any]
    tokens: TokenStatsUpdate
    digest: str | None = None


# The batch's tensors a request's statistics and records are computed from, besides the
# teacher conditions (hashed by name). (The order is part of the stored digests: a new
# per-token field goes at the end of TOKEN_FIELDS.)
_DIGESTED = ("tokens", "offsets", "group_index", "rewards", *TOKEN_FIELDS)


def request_digest(req: ComputeRequest) -> str:
    """What a request contributes, as 32 hex characters (xxh3-128: made to tell contents
    apart, 40x faster than BLAKE2b here; no one gains by forging a collision with their own
    request id): the same for a retry of the same request over any transport, different for
    another request under its id.

    Over everything of the decoded request its writes are computed from: the namespace, the
    resolved estimator and its parameters, ``ignore_token_ids``, ``vocab_size``, every tensor of
    the batch (tokens, offsets, group index, rewards, token inputs, teacher log-probs by
    condition), the group ids and prompt ids; not ``return`` (what is answered, not what is
    counted) nor the request id. Each field goes in with its name, dtype and shape, so no two
    different requests share their bytes. A tensor's bytes are hashed where they lie (CPU
    tensors, no copy); run it on a worker thread."""
    h = xxhash.xxh3_128()

    def put(name: str, data: bytes | memoryview) -> None:
        size = data.nbytes if isinstance(data, memoryview) else len(data)
        h.update(b"%s %d\n" % (name.encode(), size))
        h.update(data)

    def text(values: Sequence[str]) -> bytes:
        # (lengths, then the text: unambiguous whatever the ids hold; surrogatepass: a digest
        # never fails, whatever text the request carries)
        joined = "".join(values).encode("utf-8", "surrogatepass")
        return np.asarray([len(v) for v in values], np.int64).tobytes() + joined

    estimator = json.dumps(req.estimator.to_dict(), sort_keys=True, default=repr)
    put("namespace", req.namespace.encode("utf-8", "surrogatepass"))
    put("estimator", estimator.encode("utf-8", "surrogatepass"))
    put("ignore_token_ids", np.asarray(sorted(set(req.ignore_token_ids)), np.int64).tobytes())
    put("vocab_size", b"%d" % (-1 if req.vocab_size is None else req.vocab_size))
    batch = req.batch
    tensors: list[tuple[str, torch.Tensor | None]] = [
        (name, getattr(batch, name)) for name in _DIGESTED
    ]
    tensors += [(f"teacher:{n}", batch.teacher_logprobs[n]) for n in sorted(batch.teacher_logprobs)]
    # (after every field of earlier releases, and only where given: a request without reward
    # components keeps the digest it had)
    tensors += [
        (f"component:{n}", batch.reward_components[n]) for n in sorted(batch.reward_components)
    ]
    for name, tensor in tensors:
        if tensor is None:
            continue
        array = np.ascontiguousarray(tensor.detach().cpu().numpy())
        put(f"{name} {array.dtype.str} {array.shape}", array.reshape(-1).view(np.uint8).data)
    put("group_ids", text(batch.group_ids))
    put("prompt_ids", text(batch.prompt_ids if batch.prompt_ids is not None else []))
    return h.hexdigest()


def conflict_error(req: ComputeRequest) -> RequestError:
    """The 409 for a request whose ``request_id`` was counted before for another body."""
    return RequestError(
        "conflict",
        f"request_id {shown(req.request_id)} was already counted in namespace "
        f"{shown(req.namespace)} for a different request: a retry must resend the same request, "
        "and a new request needs a new request_id",
        field="request_id",
        status=409,
    )


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
    """The records of :func:`fold_writes`, only those of ``keys`` when given (the keys of one
    part of a write that a store asks for again, without the requests counted before)."""
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
        # The client's request id (None: no idempotency, nothing to check), the request's
        # digest, and the digest its id's claim keeps in the store.
        self._request_id = req.request_id if req.client_request_id else None
        self.digest: str | None = None
        self._claimed: str | None = None
        self._task: asyncio.Task[bool] | None = None
        self._check: asyncio.Task[None] | None = None
        loop = asyncio.get_running_loop()
        if self._keys:
            self._task = loop.create_task(self._read())
            self._task.add_done_callback(self._abandoned)
        if self._request_id is not None:
            self._check = loop.create_task(self._claim())
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
        read = await self.store.read_partly(self.req.namespace, keys, self._claim_to_read())
        if read is None:
            for pending in self._reads.values():
                pending.resolve(None)
            return False
        self._claimed = read.claimed_digest
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

    def _claim_to_read(self) -> str | None:
        """The request id whose claim to read: none while the store is known to be unreachable
        (no check then, and no error counted for it)."""
        return self._request_id if self.store.writable else None

    async def _claim(self) -> None:
        """The request's digest (on a worker thread), and, for a request that reads no records,
        the digest its id's claim keeps (a read of its own, while the request computes)."""
        self.digest = await asyncio.to_thread(request_digest, self.req)
        request_id = self._claim_to_read()
        if not self._keys and request_id is not None:
            read = await self.store.read_partly(self.req.namespace, [], request_id)
            self._claimed = None if read is None else read.claimed_digest

    def _abandoned(self, task: asyncio.Task[bool]) -> None:
        # A cancelled or failed read resolves every prior to None: no computation waits forever.
        if task.cancelled() or task.exception() is not None:
            for read in self._reads.values():
                read.resolve(None)

    def cancel(self) -> None:
        """Abandon a read still in flight (the request ended without it)."""
        for task in (self._task, self._check):
            if task is not None and not task.done():
                task.cancel()

    async def settle(self) -> str:
        """Wait for the read: the summary's ``history``. ``none``: nothing to read;
        ``unavailable``: the store could not be read; ``partial``: some groups' records could
        not be read (part of a Redis Cluster did not answer) and the others' were;
        ``applied``: earlier requests contributed to at least one group; ``empty``: the read
        succeeded and no group had anything stored (a prompt's first visit, or after its
        history expired). Also waits for the check of the request id (see
        :meth:`check_request_id`)."""
        if self._check is not None:
            # (a check that failed is no check: it never fails a request)
            with contextlib.suppress(Exception):
                await self._check
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

    def check_request_id(self) -> None:
        """Raise the 409 ``conflict`` when the request's id was counted before, in its
        namespace, for another request (call after :meth:`settle`). No conflict when the store
        could not be read or the claim keeps no digest (an earlier release's): the write then
        tells a retry from a conflict (``advantage_stats_requests_total{outcome="conflict"}``)."""
        if digests_differ(self._claimed, self.digest):
            raise conflict_error(self.req)

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
        columns: dict[str, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
        counts: TokenCounts | None = None
        for name, (state, params) in stateful_terms(self.req).items():
            prior = self._priors.get(name)
            writes = state.writes(batch, params, result.state.get(name), prior, self.options)
            counts = counts or writes.counts
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
        request_id = self._request_id
        digest = self.digest
        if request_id is not None and digest is None:  # (the check did not finish)
            digest = request_digest(req)
        return PendingWrites(
            namespace=req.namespace,
            request_id=request_id,
            records=records,
            tokens=token_statistics(batch, columns, counts),
            digest=digest,
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
    return torch.from_numpy(_distinct_sorted(keys.numpy().astype(np.int32)).astype(np.int64))


def _distinct_sorted(keys: np.ndarray) -> np.ndarray:
    """The distinct values of ``keys`` (sorted in place: pass a fresh array), ascending."""
    keys.sort()
    first = np.ones(keys.size, bool)
    np.not_equal(keys[1:], keys[:-1], out=first[1:])
    return keys[first]


def _sum_per_id(
    ids: np.ndarray, values: np.ndarray, size: int, total: np.ndarray | None
) -> np.ndarray:
    """``values`` summed per id into ``size`` bins, on top of ``total`` when given, in the order
    they come (float64; the sums of sequential additions, as ``index_add`` makes them)."""
    if total is None:
        return np.bincount(ids, weights=values, minlength=size)
    total = total.astype(np.float64, copy=False)
    np.add.at(total, ids, values)  # (a second term filling the same column: rare)
    return total


def token_statistics(
    batch: RolloutBatch,
    columns: Mapping[str, list[tuple[torch.Tensor, torch.Tensor | None]]],
    counts: TokenCounts | None = None,
) -> TokenStatsUpdate:
    """A request's vocabulary statistics: per distinct token id, the rollouts containing it with
    reward > 0 and <= 0 (presence) and its occurrences (``counts`` when a term's computation
    gave them, else counted here), plus the terms' ``columns`` (name -> (token ids, values or
    None for 1 each) pairs, summed per token id). On the CPU, with numpy, over the token ids as
    they are (a vocabulary's ids: counted in place, no map to dense ids)."""
    batch = batch.to("cpu")
    tokens = batch.tokens.numpy()
    ids_present = counts.ids if counts is not None else None
    largest = int(tokens.max() if ids_present is None else ids_present[-1]) if tokens.size else -1
    if largest < max(4 * tokens.size, 1 << 20):
        # Summed per id of the vocabulary, then the ids present picked: no sort of the ids.
        size = largest + 1
        occurrences = None
        if ids_present is None:
            occurrences = np.bincount(tokens, minlength=size)
            ids_present = np.flatnonzero(occurrences)
        uniq, ids = ids_present, tokens

        def ids_of(values: np.ndarray) -> np.ndarray:
            return values

        def pick(per_id: np.ndarray) -> np.ndarray:
            return per_id[uniq]

    else:
        uniq, inverse = (
            np.unique(tokens, return_inverse=True)
            if ids_present is None
            else (ids_present, np.searchsorted(ids_present, tokens))
        )
        size, ids = int(uniq.size), inverse.reshape(-1)
        occurrences = np.bincount(ids, minlength=size) if counts is None else None

        def ids_of(values: np.ndarray) -> np.ndarray:
            return np.searchsorted(uniq, values)

        def pick(per_id: np.ndarray) -> np.ndarray:
            return per_id

    if counts is not None:
        sums = {
            "correct": counts.correct,
            "wrong": counts.wrong,
            "occurrences": counts.occurrences,
        }
    else:
        assert occurrences is not None
        sums = _presence(batch, ids, size, pick)
        sums["occurrences"] = pick(occurrences).astype(np.int64)
    for name in TOKEN_COLUMNS:
        if name in BASE_COLUMNS:
            continue
        total: np.ndarray | None = None
        for column_ids, values in columns.get(name, []):
            ids_np = ids_of(column_ids.to("cpu").numpy())
            if values is None:
                once = np.bincount(ids_np, minlength=size)
                total = once if total is None else total + once
            else:
                weights = values.to("cpu", torch.float64).numpy()
                total = _sum_per_id(ids_np, weights, size, total)
        if total is None:
            sums[name] = np.zeros(uniq.size, np.int64 if name in COUNT_COLUMNS else np.float64)
        else:
            # (counts summed as float64 are exact below 2^53)
            summed = pick(total)
            sums[name] = summed.astype(np.int64) if name in COUNT_COLUMNS else summed
    return TokenStatsUpdate(rollouts=batch.num_rollouts, tokens=uniq.astype(np.int64), **sums)


def _presence(
    batch: RolloutBatch, ids: np.ndarray, size: int, pick: Callable[[np.ndarray], np.ndarray]
) -> dict[str, np.ndarray]:
    """``correct`` and ``wrong``: per id, the rollouts with reward > 0 and <= 0 containing it."""
    from ..estimators import kernels  # (numba is imported when a compiled loop first runs)

    correct, wrong = kernels.presence(
        ids, batch.offsets.numpy(), batch.rewards.numpy() > 0, max(size, 1)
    )
    return {"correct": pick(correct).astype(np.int64), "wrong": pick(wrong).astype(np.int64)}


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
