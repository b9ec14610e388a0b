"""The engine reads KTAE history while KTAE builds its tables.

The read needs only the prompt ids, so the engine starts it and the computation together; the
computation waits for the prior only where it merges it. These tests hold the read back and
check that the tables were built meanwhile, that the answer is the one computed with the prior
in hand, and that a read that fails or outlives the request neither fails it nor strands a
worker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from advantage_service.config import Settings
from advantage_service.errors import RequestError
from advantage_service.estimators import TermContext
from advantage_service.estimators import ktae as ktae_module
from advantage_service.estimators.ktae_history import HistoryPrior
from advantage_service.estimators.state import PendingRead
from advantage_service.observability.metrics import Metrics
from advantage_service.serving.compute import compute_request
from advantage_service.serving.engine import Engine
from advantage_service.stats import MemoryStatsStore, RecordKey
from advantage_service.wire.request import parse_request
from stats_helpers import random_groups, read_history

pytestmark = pytest.mark.anyio

NS = "overlap"


class HeldBackStore(MemoryStatsStore):
    """An in-memory store whose reads take ``delay`` seconds, or fail (``down``)."""

    def __init__(self) -> None:
        super().__init__()
        self.delay = 0.0
        self.down = False
        self.read_done: float | None = None

    async def read_records(
        self, namespace: str, keys: Sequence[RecordKey]
    ) -> list[bytes | None] | None:
        await asyncio.sleep(self.delay)
        self.read_done = time.perf_counter()
        if self.down:
            return None
        return await super().read_records(namespace, keys)


def with_prior(prior: HistoryPrior | None) -> TermContext:
    """The context of a computation handed its key-token prior before it starts."""
    return TermContext(reads={"ktae": PendingRead.of(prior)})


def engine_with(store: MemoryStatsStore, **settings: Any) -> Engine:
    engine = Engine(Settings(device="cpu", **settings), Metrics(process=False))
    engine.store = store
    return engine


def body(seed: int, prompts: list[str]) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "namespace": NS,
        "estimator": {"outcome": "grpo", "ktae": {"history": "prompt"}},
        "return": ["ktae_score"],
        "groups": random_groups(rng, prompts),
    }


@pytest.fixture
def tabulations(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """When each KTAE tabulation started."""
    started: list[float] = []
    tabulate = ktae_module.tabulate

    def timed(*args: Any, **kwargs: Any) -> Any:
        started.append(time.perf_counter())
        return tabulate(*args, **kwargs)

    monkeypatch.setattr(ktae_module, "tabulate", timed)
    return started


async def test_tables_are_built_while_the_read_is_in_flight_and_the_answer_is_unchanged(
    tabulations: list[float],
) -> None:
    store = HeldBackStore()
    engine = engine_with(store)
    prompts = ["a", "b", "c"]
    await engine.compute(parse_request(body(1, prompts)), "test")
    await engine.settle_writes()
    prior = await read_history(store, NS, prompts)
    assert prior is not None and prior.rows > 0

    store.delay = 1.0  # (ample: the tables take milliseconds)
    tabulations.clear()
    req = parse_request(body(2, prompts))
    computed = await engine.compute(req, "test")
    assert computed.summary is not None and computed.summary["history"] == "applied"
    assert tabulations and store.read_done is not None
    assert tabulations[0] < store.read_done, "KTAE tabulated only after the read finished"
    # The same numbers as a computation handed the prior before it starts.
    want = compute_request(
        parse_request(body(2, prompts)),
        "cpu",
        with_prior(prior),
    )
    assert torch.equal(computed.result.advantages, want.advantages)
    assert torch.equal(computed.result.state["ktae"].score, want.state["ktae"].score)
    assert float(want.state["ktae"].score.abs().sum()) > 0


async def test_a_failed_read_computes_without_history_and_writes_none() -> None:
    store = HeldBackStore()
    engine = engine_with(store)
    await engine.compute(parse_request(body(3, ["p"])), "test")
    await engine.settle_writes()
    before = await read_history(store, NS, ["p"])

    store.delay, store.down = 0.2, True
    computed = await engine.compute(parse_request(body(4, ["p"])), "test")
    await engine.settle_writes()
    assert computed.summary is not None and computed.summary["history"] == "unavailable"
    plain = compute_request(parse_request(body(4, ["p"])), "cpu")
    assert torch.equal(computed.result.advantages, plain.advantages)
    store.delay, store.down = 0.0, False
    after = await read_history(store, NS, ["p"])
    assert before is not None and after is not None
    assert before.stored[0] is not None and after.stored[0] is not None
    assert np.array_equal(before.stored[0].values, after.stored[0].values)


async def test_a_read_that_outlives_the_request_does_not_strand_its_worker() -> None:
    store = HeldBackStore()
    engine = engine_with(store, max_inflight=1, request_timeout_seconds=0.3)
    store.delay = 30.0
    with pytest.raises(RequestError) as raised:
        await engine.compute(parse_request(body(5, ["q"])), "test")
    assert raised.value.code == "deadline_exceeded"
    # The only worker may have been waiting for that read: the cancelled read must release it
    # (the worker stays busy until it finishes, which takes it a moment, not the read's 30 s),
    # so the next request is computed within seconds.
    store.delay = 0.0
    computed = await asyncio.wait_for(engine.compute(parse_request(body(6, ["q"])), "test"), 10)
    # (read, and nothing stored: the timed-out request wrote nothing)
    assert computed.summary is not None and computed.summary["history"] == "empty"


async def test_a_prior_that_cannot_reach_the_device_fails_the_request_without_hanging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def unmovable(self: HistoryPrior, device: Any) -> HistoryPrior:
        raise RuntimeError("device lost")

    monkeypatch.setattr(HistoryPrior, "to", unmovable)
    engine = engine_with(HeldBackStore(), max_inflight=1)
    with pytest.raises(RuntimeError, match="device lost"):
        await asyncio.wait_for(engine.compute(parse_request(body(7, ["r"])), "test"), 10)
    assert engine.inflight == 0


async def test_other_terms_run_while_ktae_waits_and_combine_in_the_same_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import dataclasses

    from advantage_service.estimators.registry import TERMS

    started: dict[str, float] = {}
    for name in ("ktae", "cscr"):
        term = TERMS[name]

        def timed(*args: Any, _fn: Any = term.fn, _name: str = name) -> Any:
            started[_name] = time.perf_counter()
            return _fn(*args)

        monkeypatch.setitem(TERMS, name, dataclasses.replace(term, fn=timed))
    store = HeldBackStore()
    engine = engine_with(store)
    rng = np.random.default_rng(8)
    groups = random_groups(rng, ["s", "t"], teacher=True)
    estimator = {"outcome": "grpo", "ktae": {"history": "prompt"}, "cscr": {}}
    request = {"namespace": NS, "estimator": estimator, "groups": groups}
    await engine.compute(parse_request(request), "test")
    await engine.settle_writes()
    prior = await read_history(store, NS, ["s", "t"])

    store.delay = 1.0
    computed = await engine.compute(parse_request(request), "test")
    assert store.read_done is not None
    assert started["cscr"] < started["ktae"] < store.read_done
    want = compute_request(parse_request(request), "cpu", with_prior(prior))
    assert torch.equal(computed.result.advantages, want.advantages)
