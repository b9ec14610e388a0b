"""``StreamCompute``'s flow: read the client's messages, decode each rollout, hand it to the
stream's group assembly (:mod:`..serving.stream_groups`: a group is computed as soon as its last
rollout is in, as one engine request), and queue each group's answer for the handler to write.
Per stream it bounds the responses outstanding (computing or not yet written): when that many
are out it stops reading, so gRPC flow control holds the client back instead of the server
buffering without end.

A stream outlives reloads of the tokens file: at each reload (and before each message read
after one) it asks what its token allows now. Revoked, the stream ends UNAUTHENTICATED (a token
that lost the stream's namespace: PERMISSION_DENIED) once the groups already computing are
answered; nothing read after the reload is computed or counted. A stream whose client has
half-closed before the reload finishes what it was sent."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from functools import partial
from typing import Any

import numpy as np
from advantage_contract.flat import (
    MAX_CONDITION_NAME_LENGTH,
    MAX_GROUP_ID_LENGTH,
    MAX_TEACHER_CONDITIONS,
)
from advantage_contract.grpc_gen import advantage_pb2 as pb

from ..batch import TOKEN_INPUTS
from ..config import Settings
from ..errors import LimitExceeded, RequestError
from ..estimators import AdvantageResult
from ..serving.auth import AuthError, Principal, unauthenticated
from ..serving.engine import Engine
from ..serving.stream_groups import (
    FailedGroup,
    StreamGroup,
    StreamGroups,
    StreamLimits,
    StreamRollout,
)
from ..serving.tenancy import Tenant
from ..wire import jsonio
from ..wire.request import ComputeRequest, RequestOptions, parse_options
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

# ---- decoding a stream's messages ---------------------------------------------------------------


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


def decode_rollout(
    rollout: pb.Rollout, rollout_index: int, room: int | None = None
) -> StreamRollout:
    """A stream rollout's arrays, checked against its own token count; with ``room``, its
    tokens against what the stream may still hold, before the other arrays are read."""
    where: dict[str, Any] = {"group_id": rollout.group_id, "rollout_index": rollout_index}
    if not rollout.HasField("tokens"):
        raise RequestError("missing_input", "tokens is required", field="tokens", **where)
    if not rollout.HasField("reward") and not rollout.reward_components:
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

    return StreamRollout(
        rollout_id=rollout.rollout_id,
        tokens=tokens,
        reward=rollout.reward if rollout.HasField("reward") else None,
        token_inputs={
            name: per_token(getattr(rollout, name), name)
            for name in TOKEN_INPUTS
            if rollout.HasField(name)
        },
        teacher_logprobs={
            name: per_token(values, f"teacher_logprobs.{name}")
            for name, values in rollout.teacher_logprobs.items()
        },
        reward_components={
            name: value.value if value.HasField("value") else None
            for name, value in rollout.reward_components.items()
        }
        or None,
    )


class WireRollout:
    """A stream message's rollout as the group assembly takes it (:class:`IncomingRollout`):
    its header as sent, its names and arrays checked and decoded here."""

    def __init__(self, message: pb.Rollout) -> None:
        self.message = message
        self.group_id: str = message.group_id
        self.group_size: int = message.group_size
        self.prompt_key: str = message.prompt_key
        self.rollout_id: str = message.rollout_id

    def check_names(self, rollout_index: int) -> None:
        check_names(self.message, rollout_index)

    def decode(self, rollout_index: int, room: int) -> StreamRollout:
        return decode_rollout(self.message, rollout_index, room)


def encode_group_result(
    group: StreamGroup, req: ComputeRequest, result: AdvantageResult, summary: dict[str, Any]
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
    """One StreamCompute call: reads rollouts, hands them to the stream's group assembly,
    computes each complete group on the engine, queues the answers for the handler to write."""

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
        self.template: RequestOptions | None = None
        self.groups = StreamGroups(engine, limits, self.tenant, settings.max_group_size)
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
        except RequestError as exc:  # a message that ends the stream (malformed, misplaced)
            # The groups read before it are answered first, as at a half-close: those computing
            # with their results, the incomplete as incomplete.
            self.ending = True
            await self._finish(exc, "the stream ended on an error")
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
        added = self.groups.add(WireRollout(message))
        if isinstance(added, FailedGroup):
            await self._fail(added)
        elif added is not None:  # complete: computed once an answer may be outstanding
            await self.outstanding.acquire()
            task = asyncio.create_task(self._compute(added))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _fail(self, failed: FailedGroup) -> None:
        """Count and answer a group that failed before it reached the engine."""
        self._reject(failed.error)
        await self._answer(group_error(failed.group_id, failed.error, failed.rollout_ids))

    def _reject(self, exc: RequestError) -> None:
        """Count a group answered with an error before it reached the engine."""
        call = self.engine.call(TRANSPORT, principal=self.principal)
        if self.template is not None:
            call.estimator, call.namespace = self.template.estimator.label, self.template.namespace
        call.finish(exc.status, exc.code)

    async def _answer(self, response: pb.StreamResponse) -> None:
        await self.outstanding.acquire()
        self.out.put_nowait(response)

    async def _finish(
        self, error: RequestError | None = None, why: str = "the stream went idle"
    ) -> None:
        """The client half-closed (or, with ``error``, went idle or sent what ends the stream):
        let computing groups finish, then answer the incomplete, then end the stream (with
        ``error``)."""
        if self.tasks:
            await asyncio.gather(*self.tasks)
        why = "the stream closed" if error is None else why
        for failed in self.groups.incomplete(why):
            await self._fail(failed)
        if error is not None:
            self._reject(error)
        self.out.put_nowait(StreamEnd(error))

    # ---- computing --------------------------------------------------------------------------

    async def _compute(self, group: StreamGroup) -> None:
        assert self.template is not None
        try:
            # Queued like any request (and merged with whatever else waits); a group refused as
            # overloaded, or that waited past the queue timeout, is its own error on the stream.
            computed = await self.engine.compute(
                partial(group.request, self.template),
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
        self.groups.release()
