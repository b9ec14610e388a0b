"""The rollouts of a :meth:`GrpcClient.stream <advantage_client.grpc_client.GrpcClient.stream>`:
read from the trainer's iterator, sent, and kept until their group is answered, so that a
reconnect sends them again."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

from advantage_contract.grpc_gen import advantage_pb2 as pb
from advantage_contract.grpc_wire import drop_failed

from .grpc_codec import rollout_message


class StreamState:
    """What a stream has sent and not had answered, so that a reconnect can send it again.

    The trainer's iterator is read on gRPC's request thread and may block for as long as a
    rollout takes to generate, so it is read outside ``lock`` (which the response side takes).
    """

    def __init__(self, source: Iterator[Mapping[str, Any]]) -> None:
        self.source = source
        self.pull_lock = threading.Lock()
        self.lock = threading.Lock()
        self.attempt = 0
        # group id -> its rollouts sent and not answered, in sending order
        self.unanswered: dict[str, list[pb.Rollout]] = {}
        # group id -> rollouts of a group answered with an error still to come (never sent:
        # the service would drop them)
        self.failed: dict[str, int] = {}
        # rollouts read for an attempt that ended meanwhile: the next attempt sends them
        self.carry: list[pb.Rollout] = []
        self.error: BaseException | None = None

    def begin(self) -> tuple[int, list[pb.Rollout]]:
        """Start an attempt: its number and the rollouts to send again first."""
        with self.lock:
            self.attempt += 1
            self.carry.clear()
            replay = [m for messages in self.unanswered.values() for m in messages]
            return self.attempt, replay

    def next_message(self, attempt: int) -> pb.Rollout | None:
        """The next rollout to send on attempt ``attempt`` (None: stop sending)."""
        with self.pull_lock:
            while True:
                with self.lock:
                    if attempt != self.attempt or self.error is not None:
                        return None
                    if self.carry:
                        return self.carry.pop(0)
                try:
                    message = rollout_message(next(self.source))
                except StopIteration:
                    return None
                except Exception as exc:  # a bad rollout dict, or the trainer's iterator failed
                    with self.lock:
                        self.error = exc
                    return None
                with self.lock:
                    gid = message.group_id
                    if drop_failed(self.failed, gid):
                        continue
                    self.unanswered.setdefault(gid, []).append(message)
                    if attempt != self.attempt:
                        self.carry.append(message)
                        return None
                    return message

    def answered(self, response: pb.StreamResponse) -> None:
        with self.lock:
            if response.WhichOneof("kind") == "result":
                self.unanswered.pop(response.result.group_id, None)
                return
            gid = response.error.group_id
            sent = self.unanswered.pop(gid, [])
            if sent and sent[0].group_size > len(sent):
                self.failed[gid] = sent[0].group_size - len(sent)

    def requests(
        self, attempt: int, options: pb.ComputeOptions, replay: list[pb.Rollout]
    ) -> Iterator[pb.StreamRequest]:
        """Attempt ``attempt``'s request messages: the options, ``replay`` (the rollouts
        :meth:`begin` gave), then fresh rollouts until the source ends or the attempt does."""
        yield pb.StreamRequest(options=options)
        for message in replay:
            yield pb.StreamRequest(rollout=message)
        while (fresh := self.next_message(attempt)) is not None:
            yield pb.StreamRequest(rollout=fresh)
