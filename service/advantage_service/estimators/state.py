"""The protocol of terms that keep state across requests.

A term that keeps state declares it at registration with a :class:`TermState`; no layer above
the term names it. Its state lives in the stats store in two forms:

- **records**: opaque bytes under keys of the term's own key space, per namespace (KTAE: one
  history record per prompt id). The term says which keys a request reads (:attr:`TermState.
  keys`), turns what was read into its prior (:attr:`TermState.decode`: a type of the term's own
  module), computes from the batch plus that prior, and says which records the request writes.
- **vocabulary statistics**: per-token-id column sums (:attr:`TermWrites.columns`) added to the
  namespace's statistics table (``GET /v1/stats/tokens``).

Per request the engine (``advantage_service.term_state``): starts the reads of every enabled
term that has keys; computes at once, each term reaching what was read through ``ctx.read`` (a
:class:`PendingRead` that resolves to the decoded prior, or to None when the store could not be
read, so a term never waits on a read that will not finish); answers; then asks each term for its
:class:`TermWrites` and hands them to the store after the answer.

Records are written only when the read succeeded: a request computed without its prior (store
down) writes none, so an outage never overwrites stored state with one visit's values. The
statistics columns are written either way.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

import numpy as np
import torch

from ..batch import RolloutBatch, Span

P = TypeVar("P")

# How a term may write its records (ADV_STATS_COMPRESSION). A term whose records do not compress
# ignores it; readers accept every kind a term ever wrote.
Compression = Literal["none", "zstd"]


@dataclass(frozen=True)
class WriteOptions:
    """Deployment settings a term's writes follow."""

    compression: Compression = "none"


@dataclass
class TokenCounts:
    """The statistics counted for every request, per distinct token id of its batch: ``ids``
    int64 (T,) ascending; int64 (T,): ``correct`` and ``wrong``, the rollouts with reward > 0
    and <= 0 containing the id, and ``occurrences``."""

    ids: np.ndarray
    correct: np.ndarray
    wrong: np.ndarray
    occurrences: np.ndarray


@dataclass
class TermWrites:
    """What one request writes for one term.

    ``records``: key -> record bytes, in the term's key space (written only when the term read,
    and its read succeeded); for a term that declares :attr:`TermState.fold`, key -> the term's
    own value of this visit, which ``fold`` turns into the bytes. ``columns``: vocabulary
    statistics column -> (token ids int64 (K,), values (K,), or None: 1 for each id, a count);
    the values are summed per token id (repeated ids add up) into the request's statistics,
    which the store adds to the namespace's. ``counts``: the request's :class:`TokenCounts`,
    from a term whose computation already has them for every token of the batch (its sort of
    the tokens): the engine then does not count them again.
    """

    records: dict[str, Any] = field(default_factory=dict)
    columns: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    counts: TokenCounts | None = None


@dataclass(frozen=True)
class TermState(Generic[P]):
    """How a term keeps state.

    - ``space``: the key space of its records in the store (None: it keeps no records, only
      statistics). Part of the stored layout: changing it starts every deployment over.
    - ``keys(batch, params)``: the record keys this request reads, one per group the term
      wants state for (empty: it reads nothing for this request).
    - ``decode(records, device)``: the prior, from the records read for ``keys`` (None where a
      key has no record), with its tensors on ``device``. Runs on a worker thread.
    - ``writes(batch, params, state, prior, options)``: the request's :class:`TermWrites`.
      ``state`` is the term's ``TermOutput.state``; ``prior`` what ``decode`` made (None when
      the term read nothing or the read failed: then no records may be written). ``batch`` is
      the request's batch as decoded (on the CPU). Runs on a worker thread after the answer.
    - ``columns``: the statistics columns ``writes`` may fill.
    - ``contributed(prior)``: whether what was read held anything from earlier requests (the
      summary's ``history`` is ``applied`` when it did for some term, ``empty`` when the read
      succeeded and found nothing); without it a successful read counts as applied.
    - ``select(state, span)``: the state of one request of a merged batch (``RolloutBatch.
      concat``; ``span`` its rollouts, groups and tokens there), as if it had been computed
      alone. A term without it is never computed merged with other requests.
    - ``fold(visits, options)``: the record bytes that several visits of one key leave, in
      their order, as writing them one after the other would (each visit applied on top of
      what the one before it left, the first on top of what it read). The writer coalesces the
      writes of many requests and writes each key once per round; ``visits`` are what
      ``writes`` put under that key for each request of the round. A term with ``fold`` puts
      its own visit values in :attr:`TermWrites.records`; a term without it puts the bytes,
      and of several visits of a key in one round the last one's are written (as one write
      after another would leave them).
    """

    writes: Callable[[RolloutBatch, Mapping[str, Any], Any, P | None, WriteOptions], TermWrites]
    columns: tuple[str, ...] = ()
    space: str | None = None
    keys: Callable[[RolloutBatch, Mapping[str, Any]], Sequence[str]] | None = None
    decode: Callable[[Sequence[bytes | None], torch.device], P] | None = None
    select: Callable[[Any, Span], Any] | None = None
    contributed: Callable[[P], bool] | None = None
    fold: Callable[[Sequence[Any], WriteOptions], bytes] | None = None

    def __post_init__(self) -> None:
        if (self.space is None) != (self.keys is None) or (self.keys is None) != (
            self.decode is None
        ):
            raise ValueError("a term that reads records declares space, keys and decode together")

    def record_bytes(self, visits: Sequence[Any], options: WriteOptions) -> bytes:
        """The bytes ``visits`` (one key's, in order, at least one) leave in the store."""
        if self.fold is not None:
            return self.fold(visits, options)
        last = visits[-1]
        if not isinstance(last, bytes):
            raise TypeError(f"a term without fold writes bytes records, not {type(last)}")
        return last

    def read_keys(self, batch: RolloutBatch, params: Mapping[str, Any]) -> list[str]:
        """The keys this request reads (none for a term without records)."""
        return [] if self.keys is None else list(self.keys(batch, params))


class PendingRead(Generic[P]):
    """A term's prior, possibly still being read: :meth:`result` waits for it.

    It resolves to None when the store could not be read (or the read was abandoned), so a
    computation that waits on it always finishes.
    """

    def __init__(self, future: concurrent.futures.Future[P | None] | None = None) -> None:
        self._future: concurrent.futures.Future[P | None] = (
            future if future is not None else concurrent.futures.Future()
        )

    @classmethod
    def of(cls, prior: P | None) -> PendingRead[P]:
        """A read that has already finished with ``prior``."""
        read: PendingRead[P] = cls()
        read.resolve(prior)
        return read

    def resolve(self, prior: P | None) -> None:
        if not self._future.done():
            self._future.set_result(prior)

    def fail(self, error: BaseException) -> None:
        """The prior could not be made (e.g. not moved to the device): the computation that
        waits for it raises ``error``."""
        if not self._future.done():
            self._future.set_exception(error)

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> P | None:
        """The prior (None: not available), waiting for the read if it is in flight."""
        return self._future.result()


__all__ = [
    "Compression",
    "PendingRead",
    "TermState",
    "TermWrites",
    "TokenCounts",
    "WriteOptions",
]
