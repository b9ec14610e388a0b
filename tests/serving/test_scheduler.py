"""The queue in front of the compute workers, on a real engine in this process: first come first
served within a namespace, round-robin across namespaces, merging of compatible requests (and
not of the others), overload answers (a full queue, a queue timeout, the byte budget), callers
that go away, and errors of one merged request that stay its own.

Workers are held and computations observed through a term registered for the test
(``holding.Hold``), through the public registry, never by patching the engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from advantage_service.config import Settings
from advantage_service.errors import Overloaded, RequestError
from advantage_service.observability.metrics import Metrics
from advantage_service.serving.engine import Engine
from advantage_service.wire.request import parse_request
from holding import Hold, held_request


@pytest.fixture
def hold() -> Iterator[Hold]:
    with Hold() as h:
        yield h


def engine_with(**settings: Any) -> Engine:
    return Engine(Settings(device="cpu", **settings), Metrics(process=False))


def request(group: str, namespace: str = "default", **estimator: Any) -> dict[str, Any]:
    """A small request with the (non-blocking) hold term, so that its computation is recorded."""
    return held_request(group, block=False, namespace=namespace) | (
        {"estimator": {"outcome": "grpo", "hold": {}, **estimator}} if estimator else {}
    )


async def until(condition: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.002)


async def start_blocked(engine: Engine, hold: Hold) -> asyncio.Task[Any]:
    """A request that occupies the (one) worker until ``hold.release``."""
    task = asyncio.ensure_future(engine.compute(parse_request(held_request()), "test"))
    await until(hold.blocked.is_set, "the held computation started")
    return task


async def queue_all(engine: Engine, bodies: list[dict[str, Any]]) -> list[asyncio.Task[Any]]:
    """Submit ``bodies`` in order, each queued before the next is sent."""
    tasks = []
    for body in bodies:
        tasks.append(asyncio.ensure_future(engine.compute(parse_request(body), "test")))
        queued = len(tasks)
        await until(lambda queued=queued: engine.scheduler.depth == queued, "the request queued")
    return tasks


def test_requests_of_one_namespace_are_computed_first_come_first_served(hold: Hold) -> None:
    engine = engine_with(max_inflight=1, max_batch_tokens=0)

    async def scenario() -> None:
        blocked = await start_blocked(engine, hold)
        tasks = await queue_all(engine, [request(f"r{i}") for i in range(6)])
        hold.release.set()
        await asyncio.gather(blocked, *tasks)

    asyncio.run(scenario())
    assert hold.computed == [["held"], *([f"r{i}"] for i in range(6))]
    engine.close()


def test_namespaces_take_turns_so_one_job_cannot_starve_another(hold: Hold) -> None:
    """Eight requests of a busy job queued before two of another team's: the other team's are
    computed second and fourth, not after all eight (round-robin), each namespace in order."""
    engine = engine_with(max_inflight=1, max_batch_tokens=0)

    async def scenario() -> None:
        blocked = await start_blocked(engine, hold)
        busy = [request(f"busy{i}", "job-a") for i in range(8)]
        other = [request(f"other{i}", "team-b") for i in range(2)]
        tasks = await queue_all(engine, busy + other)
        hold.release.set()
        await asyncio.gather(blocked, *tasks)

    asyncio.run(scenario())
    order = [groups[0] for groups in hold.computed[1:]]
    assert order[:4] == ["busy0", "other0", "busy1", "other1"]
    assert order[4:] == [f"busy{i}" for i in range(2, 8)]
    engine.close()


def test_waiting_compatible_requests_are_computed_as_one_batch(hold: Hold) -> None:
    engine = engine_with(max_inflight=1)

    async def scenario() -> list[Any]:
        blocked = await start_blocked(engine, hold)
        bodies = [request(f"m{i}", namespace=f"ns{i % 2}") for i in range(5)]
        bodies.append(request("whitened", whiten=True))  # another estimator: not merged
        tasks = await queue_all(engine, bodies)
        hold.release.set()
        await blocked
        return list(await asyncio.gather(*tasks))

    computed = asyncio.run(scenario())
    # The five compatible requests (two namespaces) shared one computation; the other ran alone.
    assert hold.computed[1] == [f"m{i}" for i in range(5)]
    assert hold.computed[2] == ["whitened"]
    assert [c.summary["batch_requests"] for c in computed] == [5] * 5 + [1]
    assert len({c.summary["compute_ms"] for c in computed[:5]}) == 1
    # Each got its own groups back, and the namespace it asked for.
    assert [c.request.batch.group_ids for c in computed[:5]] == [[f"m{i}"] for i in range(5)]
    engine.close()


def test_max_batch_tokens_bounds_a_merged_batch_and_zero_turns_merging_off(hold: Hold) -> None:
    for limit in (6, 0):  # each request has 3 tokens
        engine = engine_with(max_inflight=1, max_batch_tokens=limit)

        async def scenario(engine: Engine = engine) -> list[Any]:
            blocked = await start_blocked(engine, hold)
            tasks = await queue_all(engine, [request(f"t{i}") for i in range(6)])
            hold.release.set()
            await blocked
            return list(await asyncio.gather(*tasks))

        hold.release.clear()
        hold.blocked.clear()
        hold.computed.clear()
        computed = asyncio.run(scenario())
        sizes = [len(groups) for groups in hold.computed[1:]]
        assert sizes == ([2, 2, 2] if limit else [1] * 6), limit
        assert {c.summary["batch_requests"] for c in computed} == ({2} if limit else {1})
        engine.close()


def test_a_merged_request_that_fails_fails_alone(hold: Hold) -> None:
    """Three compatible requests, one of whose results is not finite: it alone is refused."""
    engine = engine_with(max_inflight=1)
    # A teacher shift times 1e308 overflows float32 where the teacher differs from the student.
    estimator = {"outcome": "grpo", "opsd": {"coef": 1e308}, "hold": {}}

    def body(group: str, shift: float) -> dict[str, Any]:
        rollouts = [
            {
                "tokens": [1, 2],
                "reward": r,
                "logprobs": [-1.0, -1.0],
                "teacher_logprobs": {"pos": [-1.0 + shift, -1.0]},
            }
            for r in (1.0, 0.0)
        ]
        return {"estimator": estimator, "groups": [{"id": group, "rollouts": rollouts}]}

    async def scenario() -> list[Any]:
        blocked = await start_blocked(engine, hold)
        bodies = [body("ok0", 0.0), body("bad", 0.5), body("ok1", 0.0)]
        tasks = await queue_all(engine, bodies)
        hold.release.set()
        await blocked
        return list(await asyncio.gather(*tasks, return_exceptions=True))

    ok0, bad, ok1 = asyncio.run(scenario())
    assert hold.computed[1] == ["ok0", "bad", "ok1"]  # computed together
    assert isinstance(bad, RequestError) and bad.code == "non_finite_result"
    assert bad.group_id == "bad"
    assert ok0.summary["batch_requests"] == ok1.summary["batch_requests"] == 3
    engine.close()


def test_a_full_queue_refuses_with_a_retry_hint_sized_from_the_drain_rate(hold: Hold) -> None:
    engine = engine_with(max_inflight=1, max_queue=3, max_batch_tokens=0)

    async def scenario() -> Overloaded:
        blocked = await start_blocked(engine, hold)
        tasks = await queue_all(engine, [request("q0"), request("q1")])
        with pytest.raises(Overloaded) as refused:
            await engine.compute(parse_request(request("q2")), "test")
        hold.release.set()
        await asyncio.gather(blocked, *tasks)
        return refused.value

    refused = asyncio.run(scenario())
    assert (refused.status, refused.code, refused.field) == (503, "overloaded", "queue")
    assert "ADV_MAX_QUEUE" in refused.message
    # Three requests ahead, completing at the measured rate (a first guess of 50 ms each
    # before any completion): the hint is the time they take to drain, in whole milliseconds.
    assert refused.retry_after_ms == 150
    assert refused.retry_after_seconds == 1
    counted = engine.metrics.registry.get_sample_value(
        "advantage_requests_total", {"transport": "test", "estimator": "unknown", "code": "503"}
    )
    assert counted == 1
    engine.close()


def test_a_request_that_waits_past_the_queue_timeout_is_refused_and_never_computed(
    hold: Hold,
) -> None:
    engine = engine_with(max_inflight=1, queue_timeout_seconds=0.3)

    async def scenario() -> Overloaded:
        blocked = await start_blocked(engine, hold)
        started = time.monotonic()
        with pytest.raises(Overloaded) as refused:
            await engine.compute(parse_request(request("late")), "test")
        assert 0.25 < time.monotonic() - started < 5
        assert engine.scheduler.depth == 0
        hold.release.set()
        await blocked
        return refused.value

    refused = asyncio.run(scenario())
    assert "ADV_QUEUE_TIMEOUT_SECONDS" in refused.message and refused.retry_after_ms >= 10
    assert ["late"] not in hold.computed
    engine.close()


def test_a_queued_request_whose_caller_went_away_is_dropped_without_computing(
    hold: Hold,
) -> None:
    engine = engine_with(max_inflight=1, max_batch_tokens=0)

    async def scenario() -> None:
        blocked = await start_blocked(engine, hold)
        gone, kept = await queue_all(engine, [request("gone"), request("kept")])
        gone.cancel()
        await until(lambda: engine.scheduler.depth == 1, "the cancelled request left the queue")
        hold.release.set()
        await asyncio.gather(blocked, kept)
        assert engine.inflight == 0

    asyncio.run(scenario())
    assert hold.computed[1:] == [["kept"]]
    engine.close()


def test_the_queue_holds_at_most_its_byte_budget() -> None:
    engine = engine_with(max_queue_bytes=1000)
    first = engine.admit(600)
    with pytest.raises(Overloaded) as refused:
        engine.admit(600)
    assert "ADV_MAX_QUEUE_BYTES" in refused.value.message
    second = engine.admit(400)
    # A body that grows past what it declared is held as it grows, within the same budget.
    with pytest.raises(Overloaded):
        second.hold(401)
    first.release()
    second.hold(1000)
    assert engine.scheduler.held_bytes == 1000
    second.release()
    # A lone request is admitted whatever its size (ADV_MAX_BODY_BYTES bounds it).
    with engine.admit(5000):
        assert engine.scheduler.held_bytes == 5000
    assert (engine.scheduler.held, engine.scheduler.held_bytes) == (0, 0)
    engine.close()


def test_history_requests_wait_in_the_queue_but_are_computed_alone(hold: Hold) -> None:
    engine = engine_with(max_inflight=1)
    history = {"outcome": "grpo", "hold": {}, "ktae": {"history": "prompt"}}

    async def scenario() -> list[Any]:
        blocked = await start_blocked(engine, hold)
        bodies = [request("h0") | {"estimator": history}, request("h1") | {"estimator": history}]
        tasks = await queue_all(engine, bodies)
        hold.release.set()
        await blocked
        return list(await asyncio.gather(*tasks))

    computed = asyncio.run(scenario())
    assert hold.computed[1:] == [["h0"], ["h1"]]
    assert [c.summary["history"] for c in computed] == ["empty", "empty"]  # first visits
    engine.close()


def test_past_the_refusal_point_a_request_starts_at_once_or_is_refused(hold: Hold) -> None:
    """A request that reaches the queue after ``refuse_waiting`` with a worker free is computed
    at once, not held back for company (ADV_MAX_BATCH_DELAY_MS) that could outlast the shutdown
    deadline; with the workers paused by a statistics writer behind, it is refused 503. Before,
    both waited and were cut off at the deadline (a 500 to the client)."""
    engine = engine_with(max_inflight=1, max_batch_tokens=100_000, max_batch_delay_ms=60_000)
    engine.scheduler.refuse_waiting("the service is shutting down")

    async def alone() -> Any:
        return await asyncio.wait_for(engine.compute(parse_request(request("late")), "t"), 10)

    response = asyncio.run(alone())
    assert response.summary["rollouts"] > 0
    assert hold.computed == [["late"]]

    engine.scheduler._paused = lambda: "the statistics writer is behind"
    with pytest.raises(Overloaded, match="shutting down"):
        asyncio.run(alone())
    assert hold.computed == [["late"]]
    assert engine.scheduler.depth == 0
    engine.close()
