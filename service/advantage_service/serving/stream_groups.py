"""A stream's group assembly: rollouts arrive one by one, in any order of their groups, and a
group is handed back as soon as its last rollout is in (computed as one engine request, so its
numbers are those of the group computed alone). No wire types: a transport hands in each
rollout through :class:`IncomingRollout` (its header, and how to decode the rest).

Per stream it bounds the incomplete groups and the tokens they hold (:class:`StreamLimits`);
each rollout's arrays are held in the replica's byte budget, the tenant's share of it, while
their group is incomplete. A group that fails (a rollout refused, or the stream ending before
it is complete) is answered once: its later rollouts are dropped quietly.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from advantage_contract.flat import MAX_GROUP_ID_LENGTH
from advantage_contract.grpc_wire import drop_failed

from ..batch import RolloutBatch
from ..config import Settings
from ..errors import LimitExceeded, RequestError
from ..wire.request import ComputeRequest, RequestOptions, batch_from_groups
from .engine import Engine
from .tenancy import Refusal, Tenant

# Stream limits when the settings do not carry them.
DEFAULT_STREAM_MAX_PENDING_GROUPS = 4096


@dataclass(frozen=True)
class StreamLimits:
    """Per-stream bounds: incomplete groups, the tokens they hold, and responses outstanding
    (computing or not yet written) before the stream stops reading."""

    max_pending_groups: int = DEFAULT_STREAM_MAX_PENDING_GROUPS
    max_pending_tokens: int = 8_388_608
    max_outstanding: int = 8
    # Seconds a stream may send nothing before it is ended (ADV_STREAM_IDLE_TIMEOUT_SECONDS).
    idle_timeout: float = 300.0

    @classmethod
    def from_settings(cls, settings: Settings) -> StreamLimits:
        # ADV_STREAM_MAX_PENDING_GROUPS / _TOKENS when the settings define them; by default a
        # stream holds at most as many tokens as one request may carry.
        return cls(
            max_pending_groups=int(
                getattr(settings, "stream_max_pending_groups", DEFAULT_STREAM_MAX_PENDING_GROUPS)
            ),
            max_pending_tokens=int(
                getattr(settings, "stream_max_pending_tokens", settings.max_request_tokens)
            ),
            max_outstanding=2 * settings.max_inflight,
            idle_timeout=float(getattr(settings, "stream_idle_timeout_seconds", 300.0)),
        )


@dataclass
class StreamRollout:
    """A decoded rollout of a stream."""

    rollout_id: str
    tokens: np.ndarray
    reward: float | None  # (None: not given, the sum of its reward components)
    # The optional per-token inputs given (logprobs, entropy, ...: batch.TOKEN_INPUTS).
    token_inputs: dict[str, np.ndarray]
    teacher_logprobs: dict[str, np.ndarray]
    # Named rewards (None for a component without a value); None: none given.
    reward_components: dict[str, float | None] | None = None

    @property
    def nbytes(self) -> int:
        """The bytes its arrays hold (counted in the replica's byte budget while pending)."""
        arrays = (self.tokens, *self.token_inputs.values(), *self.teacher_logprobs.values())
        return sum(int(a.nbytes) for a in arrays)


class IncomingRollout(Protocol):
    """A rollout as the transport received it: its header, read before anything is decoded,
    and the checks and decoding that are the transport's (its wire's limits and arrays)."""

    @property
    def group_id(self) -> str: ...

    @property
    def group_size(self) -> int: ...

    @property
    def prompt_key(self) -> str: ...

    @property
    def rollout_id(self) -> str: ...

    def check_names(self, rollout_index: int) -> None:
        """Raise :class:`RequestError` for names over the contract's limits."""

    def decode(self, rollout_index: int, room: int) -> StreamRollout:
        """The rollout's arrays; a :class:`LimitExceeded` when it has more than ``room``
        tokens (checked before its other arrays are read)."""


@dataclass
class StreamGroup:
    group_id: str
    size: int
    rollouts: list[StreamRollout] = field(default_factory=list)
    tokens: int = 0
    nbytes: int = 0  # held in the replica's byte budget (Budget) while pending
    completed_at: float = 0.0
    # The key of the group's history (the first rollout's prompt_key; "" for none).
    prompt_key: str = ""

    @property
    def rollout_ids(self) -> list[str]:
        return [r.rollout_id for r in self.rollouts]

    def batch(self, vocab_size: int | None) -> RolloutBatch:
        """The group as a one-group flat batch, rollouts in arrival order (built as a JSON
        request's groups are, so with the same checks and errors)."""
        rollouts = [
            {
                "tokens": r.tokens,
                "reward": r.reward,
                **r.token_inputs,
                "teacher_logprobs": r.teacher_logprobs,
                **(
                    {}
                    if r.reward_components is None
                    else {"reward_components": r.reward_components}
                ),
            }
            for r in self.rollouts
        ]
        group: dict[str, Any] = {"id": self.group_id, "rollouts": rollouts}
        if self.prompt_key:
            group["prompt_key"] = self.prompt_key
        return batch_from_groups([group], vocab_size)

    def request(self, options: RequestOptions) -> ComputeRequest:
        """The group's engine request: the stream's options, a request id of its own."""
        own = dataclasses.replace(options, request_id=uuid.uuid4().hex)
        return own.with_batch(self.batch(options.vocab_size))


@dataclass
class FailedGroup:
    """A group answered with an error: its id (empty when too long to echo) and the ids of the
    rollouts it had received."""

    group_id: str
    error: RequestError
    rollout_ids: list[str]


def _disagrees(field: str, given: object, earlier: object, gid: str, index: int) -> RequestError:
    """A rollout's ``field`` that is not what the earlier rollouts of its group gave."""
    return RequestError(
        "invalid_value",
        f"{field} is {given}, but earlier rollouts of the group gave {earlier}",
        group_id=gid,
        rollout_index=index,
        field=field,
    )


class StreamGroups:
    """One stream's incomplete groups. :meth:`add` each rollout as it arrives; it answers the
    group once complete (taken out of the pending state: its request takes its bytes again,
    admitted as any request), or the group's failure."""

    def __init__(
        self,
        engine: Engine,
        limits: StreamLimits,
        tenant: Tenant,
        max_group_size: int | None = None,
    ) -> None:
        # ``tenant``: whose byte budget the pending rollouts are held in. ``max_group_size``:
        # ADV_MAX_GROUP_SIZE (the engine's setting unless the transport serves others).
        self.engine = engine
        self.limits = limits
        self.tenant = tenant
        self.max_group_size = (
            max_group_size if max_group_size is not None else engine.settings.max_group_size
        )
        self._pending_gauge = engine.metrics.stream_pending_groups
        self.pending: dict[str, StreamGroup] = {}
        self.pending_tokens = 0
        # Groups answered with an error -> rollouts of theirs still expected (dropped).
        self.failed: collections.OrderedDict[str, int] = collections.OrderedDict()

    def add(self, rollout: IncomingRollout) -> StreamGroup | FailedGroup | None:
        """Take a rollout: the group when it completes it, the group's failure when it is
        refused (the group is dropped, and its later rollouts), None otherwise (incomplete, or
        a later rollout of a failed group, dropped)."""
        gid = rollout.group_id
        if drop_failed(self.failed, gid):  # (the rest of a group answered with an error)
            return None
        group = self.pending.get(gid)
        index = len(group.rollouts) if group is not None else 0
        try:
            group = self._open(rollout) if group is None else group
            if rollout.group_size != group.size:
                raise _disagrees("group_size", rollout.group_size, group.size, gid, index)
            if rollout.prompt_key != group.prompt_key:
                earlier = f"{group.prompt_key!r:.80}; every rollout of a group must give the same"
                raise _disagrees(
                    "prompt_key",
                    f"{rollout.prompt_key!r:.80}",
                    earlier,
                    gid,
                    index,
                )
            rollout.check_names(index)
            if rollout.rollout_id and rollout.rollout_id in group.rollout_ids:
                raise RequestError(
                    "duplicate_rollout",
                    f"rollout_id {rollout.rollout_id!r} appears twice in the group",
                    group_id=gid,
                    rollout_index=index,
                    field="rollout_id",
                )
            decoded = rollout.decode(index, self.limits.max_pending_tokens - self.pending_tokens)
            self._hold(group, decoded.nbytes)
        except RequestError as exc:
            # Answered, not raised again: without its traceback, whose frames (the caller's
            # among them, holding what this returns) would make a cycle that keeps each refused
            # rollout's message alive until the garbage collector runs.
            return self._fail(gid, exc.with_traceback(None), rollout)
        group.rollouts.append(decoded)
        group.tokens += decoded.tokens.size
        self.pending_tokens += decoded.tokens.size
        if len(group.rollouts) < group.size:
            return None
        self._close(group)
        group.completed_at = time.perf_counter()
        return group

    def _open(self, rollout: IncomingRollout) -> StreamGroup:
        """A new pending group for the rollout's group id: its first rollout checks the id,
        the size and the limit (the rollout's other names are checked for every rollout)."""
        gid = rollout.group_id
        if not gid:  # (as JSON and unary requests: every transport refuses an empty group id)
            raise RequestError(
                "invalid_value", "group_id must be a non-empty string", field="group_id"
            )
        if len(gid) > MAX_GROUP_ID_LENGTH:  # (not echoed, not held: too long to be an id)
            raise LimitExceeded(
                f"group_id has {len(gid)} characters; the limit is {MAX_GROUP_ID_LENGTH}",
                field="group_id",
            )
        size = rollout.group_size
        if size < 1:
            raise RequestError(
                "invalid_value",
                "group_size must be at least 1",
                group_id=gid,
                rollout_index=0,
                field="group_size",
            )
        if size > self.max_group_size:
            raise LimitExceeded(
                f"group {gid!r} has {size} rollouts; the limit is "
                f"{self.max_group_size} (ADV_MAX_GROUP_SIZE)",
                group_id=gid,
                field="group_size",
            )
        if len(self.pending) >= self.limits.max_pending_groups:
            raise LimitExceeded(
                f"the stream has {len(self.pending)} incomplete groups; the limit is "
                f"{self.limits.max_pending_groups} (ADV_STREAM_MAX_PENDING_GROUPS): finish "
                "groups before starting more",
                group_id=gid,
                rollout_index=0,
                field="group_id",
            )
        group = StreamGroup(gid, size, prompt_key=rollout.prompt_key)
        self.pending[gid] = group
        self._pending_gauge.inc()
        return group

    def _hold(self, group: StreamGroup, nbytes: int) -> None:
        """Hold a rollout's ``nbytes`` in the replica's byte budget, the tenant's share of it
        (the same budget as request bodies: what every stream may hold is bounded with them);
        :class:`Overloaded` (the group's error) when there is no room."""
        try:
            self.engine.budget.take(self.tenant, "bytes", nbytes)
        except Refusal as refusal:
            raise self.engine.scheduler.overloaded(str(refusal)) from None
        group.nbytes += nbytes

    def _close(self, group: StreamGroup) -> None:
        """Take a group out of the pending state (complete or failed), giving back its bytes."""
        if self.pending.pop(group.group_id, None) is not None:
            self.pending_tokens -= group.tokens
            self._pending_gauge.dec()
            self.engine.budget.give(self.tenant, "bytes", group.nbytes)

    def _fail(self, gid: str, exc: RequestError, rollout: IncomingRollout) -> FailedGroup:
        """The group's failure: drop what it holds, and its later rollouts. An id over its
        length limit is neither echoed nor remembered (its later rollouts are answered each
        with the same error)."""
        group = self.pending.get(gid)
        rollout_id = rollout.rollout_id if len(rollout.rollout_id) <= MAX_GROUP_ID_LENGTH else ""
        ids = [*(group.rollout_ids if group is not None else []), rollout_id]
        received = len(ids)
        expected = group.size if group is not None else rollout.group_size
        if group is not None:
            self._close(group)
        if len(gid) > MAX_GROUP_ID_LENGTH:
            gid = ""
        if gid and expected > received:
            self.failed[gid] = expected - received
            while len(self.failed) > self.limits.max_pending_groups:
                self.failed.popitem(last=False)
        return FailedGroup(gid, exc, ids)

    def incomplete(self, why: str) -> list[FailedGroup]:
        """The stream ended (``why``: how) with these groups incomplete: each taken out of the
        pending state, with its ``incomplete_group`` error."""
        out = []
        for group in list(self.pending.values()):
            self._close(group)
            exc = RequestError(
                "incomplete_group",
                f"group {group.group_id!r} has {len(group.rollouts)} of its {group.size} "
                f"rollouts; {why} before the rest arrived",
                group_id=group.group_id,
                field="group_size",
            )
            out.append(FailedGroup(group.group_id, exc, group.rollout_ids))
        return out

    def release(self) -> None:
        """Give back everything the pending groups hold (the stream is gone)."""
        for group in list(self.pending.values()):
            self._close(group)
        self.failed.clear()


__all__ = [
    "DEFAULT_STREAM_MAX_PENDING_GROUPS",
    "FailedGroup",
    "IncomingRollout",
    "StreamGroup",
    "StreamGroups",
    "StreamLimits",
    "StreamRollout",
]
