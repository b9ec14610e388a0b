"""How a store writes the coalesced writes of several requests (:meth:`.base.StatsStore.
record_requests`): in *groups* that each apply whole or not at all. A store that applies a write
whole (in memory, one Redis) has one group, the whole write; a Redis Cluster one per hash slot
of its records, then one per statistics bucket.

An attempt of a group claims the request ids of its members with its records, or applies
nothing and answers why:

- some of the ids were claimed before (:class:`.base.Claims`): those requests are ``duplicate``
  or ``conflict`` in this group, and the group is tried again without them;
- the store refused it whole (:class:`.base.Refused`): it is tried again in two halves, the
  first before the second, until the requests refused alone are left (``poisoned``);
- the store could not be reached (None): its members are ``lost``, the group ends.

An attempt with fewer members needs its records folded again from their visits (on top of the
members written before in the group, so that a key visited by both halves ends with every visit,
in order). The store keeps bytes and never folds: :attr:`GroupWrite.again` says what to fold,
the caller folds it and hands the bytes to :meth:`GroupWrite.send`. Groups are independent:
each round sends the next attempt of every group at once (one round trip per node), then asks
for the records the next attempts need, all at once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .base import (
    CONFLICT,
    COUNTED,
    DUPLICATE,
    LOST,
    POISONED,
    Claims,
    FoldAgain,
    Outcome,
    RecordKey,
    Refused,
    RequestWrite,
    StatsUpdate,
    Write,
)
from .blobs import merge_token_stats

Records = dict[RecordKey, bytes]


@dataclass(frozen=True)
class Attempt:
    """One try of a group: its ``tag`` (the slot or bucket on a cluster), the requests
    (positions, ascending) it claims, its records, and whether it is part of a group refused
    whole (``split``: a write id of its own on a cluster)."""

    tag: int
    members: list[int]
    records: Records
    split: bool


# What an attempt got, per attempt: Claims (empty: applied; else the members, as positions in
# the attempt's members, found claimed before, nothing applied), Refused (nothing applied) or
# None (the store, or the group's node, could not be reached).
Answer = Claims | Refused | None
Send = Callable[[list[Attempt]], Awaitable[list[Answer]]]


@dataclass
class Group:
    """A group of a write: its tag, its keys (None: every key of the write), its members."""

    tag: int
    keys: frozenset[RecordKey] | None
    members: list[int]
    # The attempts to make, the next last: (members, split); records of the next (None: to
    # be folded again).
    todo: list[tuple[list[int], bool]] = field(default_factory=list)
    records: Records | None = None
    written: list[int] = field(default_factory=list)
    duplicates: set[int] = field(default_factory=set)
    conflicts: set[int] = field(default_factory=set)
    poisoned: set[int] = field(default_factory=set)
    # An attempt got no answer (the store, or the group's node, was not reached).
    unanswered: bool = False


class GroupWrite:
    """The groups of one write, tried until every member is written, found claimed, refused
    alone or lost (see the module's docstring). ``groups``: (tag, keys, members, records of the
    first attempt); ``send`` makes attempts (one round of them at once); ``together``: the
    requests go together or not at all (:meth:`.base.StatsStore.record_many`): a group is
    never tried again (refused, its members are all poisoned)."""

    def __init__(
        self,
        requests: Sequence[RequestWrite],
        groups: Iterable[tuple[int, frozenset[RecordKey] | None, list[int], Records]],
        send: Send,
        *,
        together: bool = False,
    ) -> None:
        self.requests = requests
        self._send = send
        self.together = together
        self.groups = [
            Group(tag, keys, members, [(members, False)], records)
            for tag, keys, members, records in groups
        ]
        self.again: list[FoldAgain] = []

    async def send(self, records: Mapping[RecordKey, bytes] | None = None) -> None:
        """``records``: those :attr:`again` asked for, folded; then the rounds of attempts until
        done or records are needed again."""
        if records is not None:
            for group in self.groups:
                if group.todo and group.records is None:
                    group.records = {k: v for k, v in records.items() if self._mine(group, k)}
                    if not group.records and group.keys is not None:
                        # (a part left without records: nothing of its members to write here)
                        members, _ = group.todo.pop()
                        group.written.extend(members)
        self.again = []
        while True:
            for group in self.groups:
                if group.todo and group.records is None:
                    self._ask(group)
            if self.again:
                return
            ready = [g for g in self.groups if g.todo]
            if not ready:
                return
            attempts = []
            for group in ready:
                assert group.records is not None
                members, split = group.todo[-1]
                attempts.append(Attempt(group.tag, members, group.records, split))
            answers = await self._send(attempts)
            for group, answer in zip(ready, answers, strict=True):
                self._settle(group, answer)

    def _mine(self, group: Group, key: RecordKey) -> bool:
        return group.keys is None or key in group.keys

    def _ask(self, group: Group) -> None:
        """Ask for the records of the group's next attempt, or, when its members write none
        (statistics only), go on without any."""
        members, _ = group.todo[-1]
        keys = frozenset(
            key for i in members for key in self.requests[i].keys if self._mine(group, key)
        )
        if not keys:
            group.records = {}
            return
        self.again.append(FoldAgain(keys, tuple(sorted({*group.written, *members}))))

    def _settle(self, group: Group, answer: Answer) -> None:
        members, split = group.todo.pop()
        group.records = None
        if answer is None:
            group.unanswered = True
            group.todo.clear()  # (never split a write that may have applied part of it)
            return
        if isinstance(answer, Refused):
            if len(members) == 1 or self.together:
                group.poisoned.update(members)
                return
            half = len(members) // 2
            group.todo += [(members[half:], True), (members[:half], True)]
            return
        if not answer:
            group.written.extend(members)
            return
        before = {members[p] for p in answer.duplicates if 0 <= p < len(members)}
        other = {members[p] for p in answer.conflicts if 0 <= p < len(members)}
        group.duplicates |= before
        group.conflicts |= other
        rest = [i for i in members if i not in before and i not in other]
        if rest and len(rest) < len(members) and not self.together:
            group.todo.append((rest, split))

    @property
    def outcomes(self) -> list[Outcome]:
        """What became of each request, over every group holding it: a conflict or a refusal
        in one is the request's; it is ``lost`` unless every group holding it wrote it or found
        it claimed before; ``duplicate`` when one found it claimed (a request in no group has
        nothing to write: written)."""
        conflicts = set().union(*(g.conflicts for g in self.groups))
        poisoned = set().union(*(g.poisoned for g in self.groups))
        out: list[Outcome] = [COUNTED] * len(self.requests)
        for group in self.groups:
            for i in group.members:
                if i in group.duplicates:
                    out[i] = DUPLICATE if out[i] == COUNTED else out[i]
                elif i not in group.written:
                    out[i] = LOST
        for i in range(len(out)):
            if i in conflicts:
                out[i] = CONFLICT
            elif i in poisoned:
                out[i] = POISONED
        return out


class Finished:
    """A write that ended before it began (the store in its backoff, or not reached): every
    request has its outcome."""

    def __init__(self, outcomes: list[Outcome]) -> None:
        self.outcomes = outcomes
        self.again: list[FoldAgain] = []

    async def send(self, records: Mapping[RecordKey, bytes] | None = None) -> None:
        raise RuntimeError("this write is over: nothing to send")


class WholeWrites(Protocol):
    async def commit(
        self, namespace: str, requests: Sequence[RequestWrite], update: StatsUpdate
    ) -> Claims | None:
        """Apply ``update`` (the folded writes of ``requests``) and claim every request id,
        atomically: empty :class:`.base.Claims` when applied; the requests found claimed before
        (nothing applied); None when the store is unreachable. Raises :class:`.base.Refused`
        (nothing applied) for a write it cannot take."""
        ...


async def record_whole(store: WholeWrites, write: Write) -> GroupWrite:
    """:meth:`.base.StatsStore.record_write` for a store that applies a write whole: one
    group, the whole write, its first attempt made. k refused requests among n cost about
    2 k log2(n) more writes."""
    requests, update = write.requests, write.update

    async def send(attempts: list[Attempt]) -> list[Answer]:
        (attempt,) = attempts
        members = attempt.members
        tokens = (
            update.tokens
            if len(members) == len(requests)
            else merge_token_stats([requests[i].tokens for i in members])
        )
        part = StatsUpdate(attempt.records, tokens)
        try:
            return [await store.commit(write.namespace, [requests[i] for i in members], part)]
        except Refused as exc:
            return [exc]

    whole = (0, None, list(range(len(requests))), dict(update.records))
    groups = GroupWrite(requests, [whole], send, together=write.together)
    await groups.send()
    return groups


__all__ = [
    "Answer",
    "Attempt",
    "Finished",
    "Group",
    "GroupWrite",
    "Records",
    "Send",
    "WholeWrites",
    "record_whole",
]
