"""A stream's group assembly without a transport: rollouts in any order of their groups, each
group handed back once complete (its bytes given back), a refused rollout failing its group once
(its later rollouts dropped), and nothing of a refused rollout kept alive past its answer."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
from advantage_service.config import Settings
from advantage_service.errors import LimitExceeded, RequestError
from advantage_service.observability.metrics import Metrics
from advantage_service.serving.engine import Engine
from advantage_service.serving.scheduler import LOCAL
from advantage_service.serving.stream_groups import (
    FailedGroup,
    StreamGroup,
    StreamGroups,
    StreamLimits,
    StreamRollout,
)


@dataclass
class Incoming:
    """A rollout as a transport would hand it in (tokens 1..n, reward 1)."""

    group_id: str
    group_size: int
    rollout_id: str = ""
    tokens: int = 3
    prompt_key: str = ""
    names_error: RequestError | None = None
    checked: list[int] = field(default_factory=list)

    def check_names(self, rollout_index: int) -> None:
        self.checked.append(rollout_index)
        if self.names_error is not None:
            raise self.names_error

    def decode(self, rollout_index: int, room: int) -> StreamRollout:
        if self.tokens > room:
            raise LimitExceeded(f"{self.tokens} tokens, {room} left", field="tokens")
        tokens = np.arange(1, self.tokens + 1, dtype=np.int32)
        return StreamRollout(self.rollout_id, tokens, 1.0, {}, {})


@pytest.fixture
def engine() -> Iterator[Engine]:
    engine = Engine(Settings(device="cpu", max_group_size=4), Metrics(process=False))
    yield engine
    engine.close()


def held(engine: Engine) -> int:
    return engine.budget.usage(LOCAL).bytes


def test_groups_complete_in_any_order_and_give_their_bytes_back(engine: Engine) -> None:
    groups = StreamGroups(engine, StreamLimits(), LOCAL)
    sent = [Incoming("a", 2, "a0"), Incoming("b", 2, "b0"), Incoming("b", 2, "b1", tokens=5)]
    assert groups.add(sent[0]) is None and groups.add(sent[1]) is None
    assert groups.pending_tokens == 6 and held(engine) == 24
    done = groups.add(sent[2])
    assert isinstance(done, StreamGroup) and done.rollout_ids == ["b0", "b1"]
    assert [r.tokens.size for r in done.rollouts] == [3, 5] and list(groups.pending) == ["a"]
    assert groups.pending_tokens == 3 and held(engine) == 12
    assert [i.checked for i in sent] == [[0], [0], [1]]  # (each rollout's index in its group)
    failed = groups.incomplete("the stream closed")
    assert [(f.group_id, f.error.code, f.rollout_ids) for f in failed] == [
        ("a", "incomplete_group", ["a0"])
    ]
    assert held(engine) == 0 and groups.pending_tokens == 0


def test_a_refused_rollout_fails_its_group_once_and_drops_the_rest(engine: Engine) -> None:
    groups = StreamGroups(engine, StreamLimits(max_pending_tokens=10), LOCAL)
    assert groups.add(Incoming("g", 3, "g0")) is None
    failed = groups.add(Incoming("g", 3, "g1", tokens=8))  # 8 tokens with 7 left
    assert isinstance(failed, FailedGroup) and failed.error.code == "limit_exceeded"
    assert failed.group_id == "g" and failed.rollout_ids == ["g0", "g1"]
    assert held(engine) == 0 and not groups.pending
    assert groups.add(Incoming("g", 3, "g2")) is None and "g" not in groups.failed
    mismatch = groups.add(Incoming("h", 2, "h0")), groups.add(Incoming("h", 3, "h1"))
    assert mismatch[0] is None and isinstance(mismatch[1], FailedGroup)
    assert mismatch[1].error.field == "group_size"
    too_big = groups.add(Incoming("big", 5))
    assert isinstance(too_big, FailedGroup) and too_big.error.field == "group_size"


def refuse(groups: StreamGroups, rollout: Incoming) -> str:
    # (a caller holding the answer in a local, as a transport's handler does, until it returns)
    failed = groups.add(rollout)
    assert isinstance(failed, FailedGroup)
    return failed.error.code


def test_a_refused_rollout_is_freed_when_answered_not_by_the_collector(engine: Engine) -> None:
    groups = StreamGroups(engine, StreamLimits(), LOCAL)
    error = LimitExceeded("too many names", field="teacher_logprobs")
    gc.collect()
    gc.disable()
    try:
        for i in range(3):
            assert refuse(groups, Incoming(f"g{i}", 2, names_error=error)) == "limit_exceeded"
            assert refuse(groups, Incoming("x" * 300, 2)) == "limit_exceeded"
        assert gc.collect() == 0
    finally:
        gc.enable()
