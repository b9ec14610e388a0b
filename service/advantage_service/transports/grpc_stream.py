"""``StreamCompute``'s group assembly: rollouts arrive one by one, a group is computed as soon
as its last rollout is in (one engine request, so its numbers are those of the group computed
alone). Per stream it bounds the incomplete groups and the tokens they hold, and the responses
outstanding (computing or not yet written): when that many are out it stops reading, so gRPC
flow control holds the client back instead of the server buffering without end.

A stream outlives reloads of the tokens file: at each reload (and before each message read
after one) it asks what its token allows now. Revoked, the stream ends UNAUTHENTICATED (a token
that lost the stream's namespace: PERMISSION_DENIED) once the groups already computing are
answered; nothing read after the reload is computed or counted. A stream whose client has
half-closed before the reload finishes what it was sent."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
from advantage_client.flat import (
    MAX_CONDITION_NAME_LENGTH,
    MAX_GROUP_ID_LENGTH,
    MAX_TEACHER_CONDITIONS,
)
from advantage_client.grpc_gen import advantage_pb2 as pb

from ..batch import TOKEN_INPUTS, RolloutBatch
from ..config import Settings
from ..errors import LimitExceeded, RequestError
from ..estimators import AdvantageResult
from ..serving.auth import AuthError, Principal, unauthenticated
from ..serving.engine import Engine
from ..serving.tenancy import Refusal, Tenant
from ..wire import jsonio
from ..wire.request import (
    ComputeRequest,
    RequestOptions,
    batch_from_groups,
    parse_options,
)
from .grpc_codec import (
    INTERNAL_MESSAGE,
    TRANSPORT,
    Malformed,
    error_message,
    options_object,
    read_tensor,
    summary_message,
    write_tensor,
)

log = logging.getLogger("advantage_service.grpc")

# Stream limits when the settings do not carry them.
DEFAULT_STREAM_MAX_PENDING_GROUPS = 4096

# ---- stream assembly ---------------------------------------------------------------------------


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


class StreamIdle(Exception):
    """The client sent nothing for the idle timeout."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.error = RequestError(
            "stream_idle",
            f"the stream sent no message for {seconds:g} s (ADV_STREAM_IDLE_TIMEOUT_SECONDS): it "
            "ends, and its incomplete groups with it; open a new stream to go on",
            field="stream",
            status=504,
        )


async def _idle_bounded(
    messages: AsyncIterator[pb.StreamRequest], seconds: float
) -> AsyncIterator[pb.StreamRequest]:
    """``messages``, raising :class:`StreamIdle` when the next one takes over ``seconds``."""
    iterator = aiter(messages)
    while True:
        try:
            async with asyncio.timeout(seconds):
                message = await anext(iterator)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise StreamIdle(seconds) from None
        yield message


@dataclass
class _Rollout:
    rollout_id: str
    tokens: np.ndarray
    reward: float
    # The optional per-token inputs given (logprobs, entropy, ...: batch.TOKEN_INPUTS).
    token_inputs: dict[str, np.ndarray]
    teacher_logprobs: dict[str, np.ndarray]

    @property
    def nbytes(self) -> int:
        """The bytes its arrays hold (counted in the replica's byte budget while pending)."""
        arrays = (self.tokens, *self.token_inputs.values(), *self.teacher_logprobs.values())
        return sum(int(a.nbytes) for a in arrays)


@dataclass
class _Group:
    group_id: str
    size: int
    rollouts: list[_Rollout] = field(default_factory=list)
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
            }
            for r in self.rollouts
        ]
        group: dict[str, Any] = {"id": self.group_id, "rollouts": rollouts}
        if self.prompt_key:
            group["prompt_key"] = self.prompt_key
        return batch_from_groups([group], vocab_size)


def check_names(rollout: pb.Rollout, rollout_index: int) -> None:
    """The rollout's id and teacher condition names: the lengths of the JSON contract, and at
    most MAX_TEACHER_CONDITIONS conditions (413, nothing echoed)."""
    where: dict[str, Any] = {"group_id": rollout.group_id, "rollout_index": rollout_index}
    if len(rollout.rollout_id) > MAX_GROUP_ID_LENGTH:
        raise LimitExceeded(
            f"rollout_id has {len(rollout.rollout_id)} characters; the limit is "
            f"{MAX_GROUP_ID_LENGTH}",
            field="rollout_id",
            **where,
        )
    names = rollout.teacher_logprobs
    if len(names) > MAX_TEACHER_CONDITIONS:
        raise LimitExceeded(
            f"the rollout has {len(names)} teacher_logprobs conditions; the limit is "
            f"{MAX_TEACHER_CONDITIONS}",
            field="teacher_logprobs",
            **where,
        )
    for name in names:
        if len(name) > MAX_CONDITION_NAME_LENGTH:
            raise LimitExceeded(
                f"a teacher_logprobs condition name has {len(name)} characters; the limit is "
                f"{MAX_CONDITION_NAME_LENGTH}",
                field="teacher_logprobs",
                **where,
            )


def decode_rollout(rollout: pb.Rollout, rollout_index: int, room: int | None = None) -> _Rollout:
    """A stream rollout's arrays, checked against its own token count; with ``room``, its
    tokens against what the stream may still hold, before the other arrays are read."""
    where: dict[str, Any] = {"group_id": rollout.group_id, "rollout_index": rollout_index}
    if not rollout.HasField("tokens"):
        raise RequestError("missing_input", "tokens is required", field="tokens", **where)
    if not rollout.HasField("reward"):
        raise RequestError("missing_input", "reward is required", field="reward", **where)
    tokens = read_tensor(rollout.tokens, "tokens", integer=True, **where)
    if room is not None and tokens.size > room:
        raise LimitExceeded(
            f"incomplete groups on this stream would hold {tokens.size} more tokens with "
            f"{room} left of the limit (ADV_STREAM_MAX_PENDING_TOKENS): finish groups before "
            "sending more",
            field="tokens",
            **where,
        )

    def per_token(tensor: pb.Tensor, name: str) -> np.ndarray:
        values = read_tensor(tensor, name, integer=False, **where)
        if values.size != tokens.size:
            raise RequestError(
                "length_mismatch",
                f"{name} has {values.size} values for {tokens.size} tokens",
                field=name,
                **where,
            )
        return values

    return _Rollout(
        rollout_id=rollout.rollout_id,
        tokens=tokens,
        reward=rollout.reward,
        token_inputs={
            name: per_token(getattr(rollout, name), name)
            for name in TOKEN_INPUTS
            if rollout.HasField(name)
        },
        teacher_logprobs={
            name: per_token(values, f"teacher_logprobs.{name}")
            for name, values in rollout.teacher_logprobs.items()
        },
    )


def encode_group_result(
    group: _Group, req: ComputeRequest, result: AdvantageResult, summary: dict[str, Any]
) -> pb.StreamResponse:
    """A computed group: one RolloutResult per rollout, in arrival order."""
    offsets = req.batch.offsets.cpu().numpy()
    advantages = result.advantages.cpu().numpy()
    scalars = result.scalars.cpu().numpy() if "scalar" in req.returns else None
    diagnostics = {
        name: result.diagnostics[name].cpu().numpy() for name in req.returns if name != "scalar"
    }
    out = pb.GroupResult(
        group_id=group.group_id,
        request_id=req.request_id,
        estimator_json=jsonio.dumps(req.estimator.to_dict()),
        summary=summary_message(summary),
    )
    for i, rollout in enumerate(group.rollouts):
        start, end = int(offsets[i]), int(offsets[i + 1])
        item = out.rollouts.add(
            rollout_id=rollout.rollout_id,
            rollout_index=i,
            advantages=write_tensor(advantages[start:end]),
        )
        if scalars is not None:
            item.scalar = float(scalars[i])
        for name, values in diagnostics.items():
            item.diagnostics[name].CopyFrom(write_tensor(values[start:end]))
    return pb.StreamResponse(result=out)


def group_error(group_id: str, exc: RequestError, rollout_ids: Sequence[str]) -> pb.StreamResponse:
    return pb.StreamResponse(
        error=pb.GroupError(
            group_id=group_id, error=error_message(exc), rollout_ids=list(rollout_ids)
        )
    )


class StreamEnd:
    """The writer's stop mark; ``error`` set: end the call with it instead of OK."""

    def __init__(self, error: RequestError | None = None, internal: bool = False) -> None:
        self.error = error
        self.internal = internal


class StreamSession:
    """One StreamCompute call: reads rollouts, assembles groups, computes them on the engine,
    queues the answers for the handler to write."""

    def __init__(
        self,
        engine: Engine,
        settings: Settings,
        limits: StreamLimits,
        principal: Principal,
        tenant: Tenant | None = None,
    ) -> None:
        # What the session needs is passed in, not read off the servicer: the servicer imports
        # this module, and this module imports nothing of the servicer's.
        self.principal = principal
        # Whose budget the stream's pending rollouts and its groups' requests count against.
        self.tenant = tenant if tenant is not None else engine.tenant(principal)
        self.engine = engine
        self.settings = settings
        self.limits = limits
        self.metrics = engine.metrics
        self.template: RequestOptions | None = None
        self.pending: dict[str, _Group] = {}
        self.pending_tokens = 0
        # Groups answered with an error -> rollouts of theirs still expected (dropped).
        self.failed: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.out: asyncio.Queue[pb.StreamResponse | StreamEnd] = asyncio.Queue()
        self.outstanding = asyncio.Semaphore(self.limits.max_outstanding)
        self.tasks: set[asyncio.Task[None]] = set()
        self.reader: asyncio.Task[None] | None = None
        self.watcher: asyncio.Task[None] | None = None
        # The tokens' reload generation the principal was last checked at (-1: check before
        # the first message, in case a reload came between the call's authentication and now).
        self.checked_generation = -1
        # Set once the stream's end is decided (a StreamEnd is, or is about to be, queued).
        self.ending = False

    def start(self, requests: AsyncIterator[pb.StreamRequest]) -> None:
        """Read the client's messages, and with a tokens file watch its reloads, on tasks of
        their own (:meth:`release` cancels them)."""
        self.reader = asyncio.create_task(self.read(requests))
        if self.engine.auth.enabled:
            self.watcher = asyncio.create_task(self.watch_token())

    # ---- the token, across reloads ----------------------------------------------------------

    def token_error(self) -> AuthError | None:
        """What ends the stream under the tokens in force now: its token no longer in the file
        (401), or no longer allowing the stream's namespace (403); None while it is allowed
        (the principal then takes the token's namespaces as they are now)."""
        auth = self.engine.auth
        self.checked_generation = auth.generation
        principal = auth.current(self.principal)
        if principal is None:
            return unauthenticated(
                "the bearer token was revoked (it is no longer in the tokens file): the stream "
                "ends, and nothing sent after the revocation is computed"
            )
        self.principal = principal
        namespace = self.template.namespace if self.template is not None else None
        if namespace is not None and not principal.allows(namespace):
            return AuthError(
                "permission_denied",
                f"the token no longer allows namespace {namespace!r}: the stream ends, and "
                "nothing sent after the change is computed",
                status=403,
                field="namespace",
            )
        return None

    def _check_token(self) -> None:
        """Before a message is used: raise :meth:`token_error`'s error when the tokens were
        reloaded since the last check (a generation compare otherwise: nothing to look up)."""
        if self.engine.auth.generation != self.checked_generation:
            error = self.token_error()
            if error is not None:
                raise error

    async def watch_token(self) -> None:
        """End the stream when a reload revokes its token, also while the client sends nothing
        (the reader is stopped: nothing it would read after the reload is computed)."""
        while (error := self.token_error()) is None:
            # (No await between the check and this wait: no reload can be missed.)
            await self.engine.auth.reloaded()
        if self.ending:  # the reader ends the stream already (or the client half-closed)
            return
        if self.reader is not None:
            self.reader.cancel()
        await self.end(error)

    async def end(self, error: RequestError) -> None:
        """End the stream with ``error`` once the groups already computing are answered (they
        were read before it; their answers are written first), counting it once."""
        self.ending = True
        if self.tasks:
            await asyncio.wait(set(self.tasks))
        self._reject(error)
        self.out.put_nowait(StreamEnd(error))

    # ---- reading ----------------------------------------------------------------------------

    async def read(self, requests: AsyncIterator[pb.StreamRequest]) -> None:
        """Consume the client's messages until it half-closes, then flush and mark the end."""
        try:
            first = True
            async for message in _idle_bounded(requests, self.limits.idle_timeout):
                self._check_token()  # a reload since the last message: is the token still good?
                if isinstance(message, Malformed):
                    raise message.error()
                kind = message.WhichOneof("kind")
                if kind == "options":
                    if not first:
                        raise RequestError(
                            "invalid_stream",
                            "options may only be the first message of the stream",
                            field="options",
                        )
                    self.template = self._template(options_object(message.options))
                elif kind == "rollout":
                    if self.template is None:
                        self.template = self._template({})
                    await self._add(message.rollout)
                else:
                    raise RequestError(
                        "invalid_stream",
                        "a stream message must carry options or a rollout",
                        field="kind",
                    )
                first = False
            self.ending = True
            await self._finish()
        except StreamIdle as idle:
            # The client sent nothing for the idle timeout: its incomplete groups are answered
            # (failed) and the stream ends, so an abandoned stream holds no place.
            self.ending = True
            await self._finish(idle.error)
        except AuthError as exc:  # revoked mid-stream, or its namespace not allowed
            await self.end(exc)
        except RequestError as exc:
            self.ending = True
            self._reject(exc)
            self.out.put_nowait(StreamEnd(exc))
        except asyncio.CancelledError:
            raise
        except Exception:
            self.ending = True
            log.exception("internal error reading a stream")
            self.out.put_nowait(StreamEnd(internal=True))

    def _template(self, options: dict[str, Any]) -> RequestOptions:
        """The stream's options, checked once: every group's request is these with its batch."""
        template = parse_options(options)
        # Every group of the stream is in this namespace: one check for the whole stream.
        self.principal.authorize(template.namespace)
        return template

    async def _add(self, message: pb.Rollout) -> None:
        gid = message.group_id
        remaining = self.failed.get(gid)
        if remaining is not None:
            # The rest of a group already answered with an error: drop it quietly.
            if remaining <= 1:
                del self.failed[gid]
            else:
                self.failed[gid] = remaining - 1
            return
        group = self.pending.get(gid)
        index = len(group.rollouts) if group is not None else 0
        try:
            group = self._open(message) if group is None else group
            if message.group_size != group.size:
                raise RequestError(
                    "invalid_value",
                    f"group_size is {message.group_size}, but earlier rollouts of the group "
                    f"gave {group.size}",
                    group_id=gid,
                    rollout_index=index,
                    field="group_size",
                )
            if message.prompt_key != group.prompt_key:
                raise RequestError(
                    "invalid_value",
                    f"prompt_key is {message.prompt_key!r:.80}, but earlier rollouts of the group "
                    f"gave {group.prompt_key!r:.80}; every rollout of a group must give the same",
                    group_id=gid,
                    rollout_index=index,
                    field="prompt_key",
                )
            check_names(message, index)
            if message.rollout_id and message.rollout_id in group.rollout_ids:
                raise RequestError(
                    "duplicate_rollout",
                    f"rollout_id {message.rollout_id!r} appears twice in the group",
                    group_id=gid,
                    rollout_index=index,
                    field="rollout_id",
                )
            room = self.limits.max_pending_tokens - self.pending_tokens
            rollout = decode_rollout(message, index, room)
            self._hold(group, rollout.nbytes)
        except RequestError as exc:
            await self._fail(gid, exc, message)
            return
        group.rollouts.append(rollout)
        group.tokens += rollout.tokens.size
        self.pending_tokens += rollout.tokens.size
        if len(group.rollouts) == group.size:
            self._close(group)
            group.completed_at = time.perf_counter()
            await self.outstanding.acquire()
            task = asyncio.create_task(self._compute(group))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def _open(self, message: pb.Rollout) -> _Group:
        """A new pending group for the message's group id: its first rollout checks the id,
        the size and the limit (the rollout's other names are checked for every rollout)."""
        gid = message.group_id
        if not gid:  # (as JSON and unary requests: every transport refuses an empty group id)
            raise RequestError(
                "invalid_value", "group_id must be a non-empty string", field="group_id"
            )
        if len(gid) > MAX_GROUP_ID_LENGTH:  # (not echoed, not held: too long to be an id)
            raise LimitExceeded(
                f"group_id has {len(gid)} characters; the limit is {MAX_GROUP_ID_LENGTH}",
                field="group_id",
            )
        size = message.group_size
        if size < 1:
            raise RequestError(
                "invalid_value",
                "group_size must be at least 1",
                group_id=gid,
                rollout_index=0,
                field="group_size",
            )
        if size > self.settings.max_group_size:
            raise LimitExceeded(
                f"group {gid!r} has {size} rollouts; the limit is "
                f"{self.settings.max_group_size} (ADV_MAX_GROUP_SIZE)",
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
        group = _Group(gid, size, prompt_key=message.prompt_key)
        self.pending[gid] = group
        self.metrics.stream_pending_groups.inc()
        return group

    def _hold(self, group: _Group, nbytes: int) -> None:
        """Hold a rollout's ``nbytes`` in the replica's byte budget, the tenant's share of it
        (the same budget as request bodies: what every stream may hold is bounded with them);
        :class:`Overloaded` (the group's error) when there is no room."""
        try:
            self.engine.budget.take(self.tenant, "bytes", nbytes)
        except Refusal as refusal:
            raise self.engine.scheduler.overloaded(str(refusal)) from None
        group.nbytes += nbytes

    def _close(self, group: _Group) -> None:
        """Take a group out of the pending state (complete or failed), giving back its bytes
        (a complete group's request takes them again, admitted as any request)."""
        if self.pending.pop(group.group_id, None) is not None:
            self.pending_tokens -= group.tokens
            self.metrics.stream_pending_groups.dec()
            self.engine.budget.give(self.tenant, "bytes", group.nbytes)

    async def _fail(self, gid: str, exc: RequestError, message: pb.Rollout) -> None:
        """Answer the group with ``exc``, drop what it holds, and drop its later rollouts. An
        id over its length limit is neither echoed nor remembered (its later rollouts are
        answered each with the same error)."""
        group = self.pending.get(gid)
        rollout_id = message.rollout_id if len(message.rollout_id) <= MAX_GROUP_ID_LENGTH else ""
        ids = [*(group.rollout_ids if group is not None else []), rollout_id]
        received = len(ids)
        expected = group.size if group is not None else message.group_size
        if group is not None:
            self._close(group)
        if len(gid) > MAX_GROUP_ID_LENGTH:
            gid = ""
        if gid and expected > received:
            self.failed[gid] = expected - received
            while len(self.failed) > self.limits.max_pending_groups:
                self.failed.popitem(last=False)
        self._reject(exc)
        await self._answer(group_error(gid, exc, ids))

    def _reject(self, exc: RequestError) -> None:
        """Count a group answered with an error before it reached the engine."""
        call = self.engine.call(TRANSPORT, principal=self.principal)
        if self.template is not None:
            call.estimator, call.namespace = self.template.estimator.label, self.template.namespace
        call.finish(exc.status, exc.code)

    async def _answer(self, response: pb.StreamResponse) -> None:
        await self.outstanding.acquire()
        self.out.put_nowait(response)

    async def _finish(self, error: RequestError | None = None) -> None:
        """The client half-closed (or, with ``error``, went idle): let computing groups
        finish, then answer the incomplete, then end the stream (with ``error``)."""
        if self.tasks:
            await asyncio.gather(*self.tasks)
        why = "the stream closed" if error is None else "the stream went idle"
        for group in list(self.pending.values()):
            self._close(group)
            exc = RequestError(
                "incomplete_group",
                f"group {group.group_id!r} has {len(group.rollouts)} of its {group.size} "
                f"rollouts; {why} before the rest arrived",
                group_id=group.group_id,
                field="group_size",
            )
            self._reject(exc)
            await self._answer(group_error(group.group_id, exc, group.rollout_ids))
        if error is not None:
            self._reject(error)
        self.out.put_nowait(StreamEnd(error))

    # ---- computing --------------------------------------------------------------------------

    async def _compute(self, group: _Group) -> None:
        assert self.template is not None
        template = self.template

        def decode() -> ComputeRequest:
            options = dataclasses.replace(template, request_id=uuid.uuid4().hex)
            return options.with_batch(group.batch(template.vocab_size))

        try:
            # Queued like any request (and merged with whatever else waits); a group refused as
            # overloaded, or that waited past the queue timeout, is its own error on the stream.
            computed = await self.engine.compute(
                decode,
                TRANSPORT,
                encode=partial(encode_group_result, group),
                started=group.completed_at,
                principal=self.principal,
                tenant=self.tenant,
                nbytes=group.nbytes,
            )
            assert computed.encoded is not None
            response = computed.encoded
        except RequestError as exc:
            response = group_error(group.group_id, exc, group.rollout_ids)
        except asyncio.CancelledError:
            self.outstanding.release()
            raise
        except Exception:
            log.exception("internal error computing stream group %r", group.group_id)
            internal = RequestError("internal", INTERNAL_MESSAGE, group_id=group.group_id)
            response = group_error(group.group_id, internal, group.rollout_ids)
        self.out.put_nowait(response)

    # ---- teardown ---------------------------------------------------------------------------

    def release(self) -> None:
        """Free everything the stream holds (on any exit, cancellation included)."""
        for helper in (self.reader, self.watcher):
            if helper is not None:
                helper.cancel()
        for task in list(self.tasks):
            task.cancel()
        for group in list(self.pending.values()):
            self._close(group)
        self.failed.clear()
