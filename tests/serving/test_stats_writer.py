"""The statistics writes after the answer, through the engine: what ``summary.recorded``
promises, the pushback when the writes are behind, coalesced rounds and their idempotency, and
an unreachable store.

The seam is the store: a real in-memory store whose writes the test holds back (the writer is
then behind, as with a slow store), one whose writes report it unreachable, and a Redis store on
a port nothing listens on.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import pytest
from advantage_service.config import Settings
from advantage_service.errors import Overloaded, RequestError
from advantage_service.observability.metrics import Metrics
from advantage_service.serving.compute import compute_request
from advantage_service.serving.engine import Computed, Engine
from advantage_service.stats import MemoryStatsStore, RedisStatsStore, StatsStore, StatsUpdate
from advantage_service.stats.base import Claims, RequestWrite
from advantage_service.wire.request import parse_request
from process_support import free_port
from prometheus_client.parser import text_string_to_metric_families
from stats.redis_support import RedisServer

NS = "writes"
ROLLOUTS = 4


class HeldStore(MemoryStatsStore):
    """An in-memory store whose writes wait until the test lets them go (``release``)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.writes: list[list[str]] = []  # the request ids of each write, in order

    async def commit(
        self, namespace: str, requests: Sequence[RequestWrite], update: StatsUpdate
    ) -> Claims | None:
        self.writes.append([r.request_id for r in requests if r.request_id is not None])
        await self.release.wait()
        return await super().commit(namespace, requests, update)


class VanishingStore(MemoryStatsStore):
    """Writable when asked, unreachable when written to (the store failed after the answer)."""

    async def commit(
        self, namespace: str, requests: Sequence[RequestWrite], update: StatsUpdate
    ) -> Claims | None:
        return None


def body(seed: int, *, request_id: str | None = None, history: bool = True) -> dict[str, Any]:
    """A small request over two prompts of a small vocabulary (prompts recur across seeds)."""
    rng = np.random.default_rng(seed)
    groups = [
        {
            "id": f"p{prompt}",
            "rollouts": [
                {"tokens": rng.integers(0, 30, size=6).tolist(), "reward": float(r % 2)}
                for r in range(ROLLOUTS // 2)
            ],
        }
        for prompt in (seed % 3, 3 + seed % 2)
    ]
    ktae: dict[str, Any] = {"history": "prompt"} if history else {}
    out: dict[str, Any] = {
        "namespace": NS,
        "estimator": {"outcome": "grpo", "ktae": ktae},
        "groups": groups,
    }
    if request_id is not None:
        out["request_id"] = request_id
    return out


class Counting:
    """The engine's compute seam, counting the computations that start."""

    def __init__(self) -> None:
        self.started = 0

    def __call__(self, *args: Any) -> Any:
        self.started += 1
        return compute_request(*args)


def engine_with(
    store: StatsStore, metrics: Metrics | None = None, **overrides: Any
) -> tuple[Engine, Counting]:
    counting = Counting()
    metrics = metrics if metrics is not None else Metrics(process=False)
    engine = Engine(Settings(device="cpu", **overrides), metrics, store=store, compute=counting)
    return engine, counting


def run_engine(
    scenario: Callable[[Engine, Counting], Awaitable[None]],
    store: StatsStore,
    metrics: Metrics | None = None,
    **overrides: Any,
) -> None:
    """Run ``scenario`` on an engine over ``store`` (:func:`engine_with`), closed after."""

    async def main() -> None:
        engine, counting = engine_with(store, metrics, **overrides)
        try:
            await scenario(engine, counting)
        finally:
            engine.close()

    asyncio.run(main())


def outcomes(engine: Engine) -> dict[str, float]:
    """advantage_stats_requests_total by outcome, the outcomes that happened (every outcome is
    exported from the start, at 0)."""
    text = engine.metrics.render().decode()
    return {
        s.labels["outcome"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "advantage_stats_requests_total" and s.value
    }


def store_errors(engine: Engine) -> dict[str, float]:
    text = engine.metrics.render().decode()
    return {
        s.labels["op"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "advantage_stats_store_errors_total"
    }


async def rollouts_counted(store: StatsStore) -> int:
    stats = await store.token_stats(NS, "occurrences", 1)
    assert stats is not None
    return int(stats["rollouts_counted"])


async def compute(engine: Engine, seed: int, **options: Any) -> Computed[Any]:
    return await engine.compute(parse_request(body(seed, **options)), "test")


def test_with_the_writes_held_back_requests_wait_then_get_503_never_recorded_false() -> None:
    store = HeldStore()

    async def scenario(engine: Engine, counting: Counting) -> None:
        # Two answers fill the backlog (the first one's write is held in the store).
        first = [await compute(engine, seed) for seed in (1, 2)]
        assert [c.summary["recorded"] for c in first] == [True, True]
        assert engine.writer.backlog == 2 and counting.started == 2

        # Behind: the next requests wait in the queue (no computation starts), then 503.
        started = time.monotonic()
        waiting = [asyncio.ensure_future(compute(engine, seed)) for seed in range(3, 8)]
        await asyncio.sleep(0.1)
        # The queue is full (ADV_MAX_QUEUE 5: all waiting), so one more is refused at once.
        with pytest.raises(Overloaded):
            await compute(engine, 99)
        outcomes_ = await asyncio.gather(*waiting, return_exceptions=True)
        waited = time.monotonic() - started
        assert all(isinstance(o, Overloaded) for o in outcomes_), outcomes_
        refused = [o for o in outcomes_ if isinstance(o, Overloaded)]
        assert all(o.retry_after_ms > 0 for o in refused)
        assert "statistics writes" in str(refused[0])
        assert waited >= 0.55, "they waited for the writer before the 503"
        assert counting.started == 2, "no computation started while the writes were behind"
        assert outcomes(engine).get("refused", 0) == 0

        # The store catches up: both accepted requests are counted, and requests are
        # computed and recorded again.
        store.release.set()
        assert await engine.settle_writes(10) == 0
        assert await rollouts_counted(store) == 2 * ROLLOUTS
        again = await compute(engine, 8)
        assert again.summary["recorded"] is True
        assert await engine.settle_writes(10) == 0
        assert await rollouts_counted(store) == 3 * ROLLOUTS
        assert outcomes(engine) == {"counted": 3.0}

    run_engine(
        scenario, store, max_inflight=1, stats_max_backlog=2, queue_timeout_seconds=0.6, max_queue=5
    )


def test_requests_answered_while_a_write_is_held_are_coalesced_into_one_round() -> None:
    store = HeldStore()

    async def scenario(engine: Engine, _: Counting) -> None:
        answers = [await compute(engine, seed, request_id=f"r{seed}") for seed in range(6)]
        assert all(a.summary["recorded"] for a in answers)
        store.release.set()
        assert await engine.settle_writes(10) == 0
        # The first write held the rest back: they went to the store as one write.
        assert store.writes == [["r0"], [f"r{seed}" for seed in range(1, 6)]]
        assert await rollouts_counted(store) == 6 * ROLLOUTS

    run_engine(scenario, store, stats_max_backlog=64)


def test_a_request_id_is_counted_once_inside_a_coalesced_round_and_across_rounds() -> None:
    store = HeldStore()

    async def scenario(engine: Engine, _: Counting) -> None:
        await compute(engine, 0, request_id="early")  # its write is held: round one
        # Round two: "early" resent (counted in round one), "twice" twice, "once" (a
        # resend is the same request again: the same body).
        for seed, rid in [(1, "twice"), (0, "early"), (1, "twice"), (4, "once")]:
            assert (await compute(engine, seed, request_id=rid)).summary["recorded"]
        # And one without an id: no idempotency asked for, always counted.
        await compute(engine, 5)
        store.release.set()
        assert await engine.settle_writes(10) == 0
        # early (round one), twice, once and the one without an id.
        assert await rollouts_counted(store) == 4 * ROLLOUTS
        assert outcomes(engine) == {"counted": 4.0, "duplicate": 2.0}
        # Round two was written once more without "early", which the store refused.
        assert store.writes[1] == ["twice", "early", "once"]
        assert store.writes[2] == ["twice", "once"]

    run_engine(scenario, store, stats_max_backlog=64)


def test_two_bodies_under_one_request_id_at_once_count_one_and_flag_the_other() -> None:
    """The race the check before the answer cannot see: a second body under an id whose first
    body is not written yet is answered, then found at the write (the store's claim keeps the
    first body's digest, or both are in one round) and counted ``conflict``, not counted; once
    the first is written, another body under its id is refused (409)."""

    store = HeldStore()

    async def scenario(engine: Engine, _: Counting) -> None:
        await compute(engine, 0, request_id="raced")  # its write is held: round one
        # Round two: another body under "raced" (claimed in round one, not yet written),
        # and two bodies under "pair", neither written before.
        for seed, rid in [(1, "raced"), (2, "pair"), (3, "pair")]:
            assert (await compute(engine, seed, request_id=rid)).summary["recorded"]
        store.release.set()
        assert await engine.settle_writes(10) == 0
        assert outcomes(engine) == {"counted": 2.0, "conflict": 2.0}
        assert await rollouts_counted(store) == 2 * ROLLOUTS
        # Written now: another body under either id is refused before it is answered.
        for seed, rid in [(4, "raced"), (5, "pair")]:
            with pytest.raises(RequestError) as info:
                await compute(engine, seed, request_id=rid)
            assert (info.value.status, info.value.code, info.value.field) == (
                409,
                "conflict",
                "request_id",
            )
        # The same bodies again are retries: answered, not counted again.
        assert (await compute(engine, 0, request_id="raced")).summary["recorded"]
        assert (await compute(engine, 2, request_id="pair")).summary["recorded"]
        assert await engine.settle_writes(10) == 0
        assert outcomes(engine) == {"counted": 2.0, "conflict": 2.0, "duplicate": 2.0}

    run_engine(scenario, store, stats_max_backlog=64)


def test_an_unreachable_redis_answers_recorded_false_and_counts_it() -> None:
    async def scenario() -> None:
        # Nothing listens on the port: every call fails at once, then the store backs off.
        metrics = Metrics(process=False)
        store = RedisStatsStore(
            f"redis://127.0.0.1:{free_port()}/0",
            backoff_initial=30.0,
            backoff_max=30.0,
            on_error=lambda op: metrics.stats_store_errors_total.labels(op).inc(),
        )
        engine, _ = engine_with(store, metrics)
        try:
            with_history = await compute(engine, 1)
            assert with_history.summary["history"] == "unavailable"
            assert with_history.summary["recorded"] is False
            plain = await compute(engine, 2, history=False)
            assert plain.summary["recorded"] is False
            assert outcomes(engine) == {"refused": 2.0}
            assert store_errors(engine).get("read_history", 0) >= 1
        finally:
            await store.close()
            engine.close()

    asyncio.run(scenario())


def test_statistics_lost_after_the_answer_are_counted_lost() -> None:
    async def scenario(engine: Engine, _: Counting) -> None:
        assert (await compute(engine, 1)).summary["recorded"] is True
        assert await engine.settle_writes(10) == 0
        assert outcomes(engine) == {"lost": 1.0}

    run_engine(scenario, VanishingStore())


class UnreachableFor(MemoryStatsStore):
    """Unreachable for its first ``failures`` writes (as a Redis that missed a timeout, or a
    cluster master that did not answer), then written; ``applied_first``: the first failed
    write reached the store after all (its answer was lost), as a timeout can leave it."""

    def __init__(self, failures: int, *, applied_first: bool = False) -> None:
        super().__init__()
        self.failures = failures
        self.applied_first = applied_first
        self.tries: list[tuple[float, list[str]]] = []  # (when, request ids) of each write

    async def commit(
        self, namespace: str, requests: Sequence[RequestWrite], update: StatsUpdate
    ) -> Claims | None:
        self.tries.append((time.monotonic(), [r.request_id or "-" for r in requests]))
        if len(self.tries) <= self.failures:
            if self.applied_first and len(self.tries) == 1:
                await super().commit(namespace, requests, update)
            return None
        return await super().commit(namespace, requests, update)


def test_a_write_that_did_not_reach_the_store_is_written_again_and_counted_once() -> None:
    store = UnreachableFor(3)

    async def scenario(engine: Engine, _: Counting) -> None:
        answer = await compute(engine, 1, request_id="blip")
        assert answer.summary["recorded"] is True
        assert await engine.settle_writes(20) == 0
        assert await rollouts_counted(store) == ROLLOUTS
        assert outcomes(engine) == {"counted": 1.0}
        # Three tries that did not reach it, then one that did, each pause longer than the last
        # (0.25, 0.5, 1 s: the store's own backoff).
        times = [t for t, _ in store.tries]
        assert [ids for _, ids in store.tries] == [["blip"]] * 4
        pauses = np.diff(times)
        assert list(pauses) == sorted(pauses) and pauses[0] >= 0.2, pauses

    run_engine(scenario, store)


def test_a_write_that_reached_the_store_unanswered_is_not_counted_twice() -> None:
    store = UnreachableFor(1, applied_first=True)

    async def scenario(engine: Engine, _: Counting) -> None:
        assert (await compute(engine, 1, request_id="late-answer")).summary["recorded"]
        assert await engine.settle_writes(20) == 0
        # Written again, the claim of the first try was found: counted once.
        assert await rollouts_counted(store) == ROLLOUTS
        assert outcomes(engine) == {"duplicate": 1.0}
        assert len(store.tries) == 2

    run_engine(scenario, store)


def test_statistics_that_never_reach_the_store_are_lost_after_the_retry_window_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = VanishingStore()

    async def scenario(engine: Engine, _: Counting) -> None:
        start = time.monotonic()
        assert (await compute(engine, 1, request_id="gone")).summary["recorded"]
        # Without an id a write cannot be made again safely: lost at the first failure.
        assert (await compute(engine, 2)).summary["recorded"]
        assert await engine.settle_writes(20) == 0
        assert 0.8 <= time.monotonic() - start < 10
        assert outcomes(engine) == {"lost": 2.0}

    with caplog.at_level("WARNING", logger="advantage_service.stats_writer"):
        run_engine(scenario, store, stats_retry_seconds=0.8)
    lines = [r.getMessage() for r in caplog.records]
    assert any("not written" in line and "'gone'" in line for line in lines), lines
    assert any("not written" in line and "(none)" in line for line in lines), lines


def test_writes_waiting_for_the_store_do_not_hold_computations_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An outage must not stop requests that do not need the store: those waiting to be written
    again are not the backlog that pauses the queue (here two requests' worth); at most that
    many wait, the oldest past it is lost (counted and logged)."""
    store = VanishingStore()

    async def scenario(engine: Engine, counting: Counting) -> None:
        for seed in range(4):
            answer = await compute(engine, seed, request_id=f"w{seed}")
            assert answer.summary["recorded"] is True
            await asyncio.sleep(0.05)  # (its first write fails meanwhile)
        assert counting.started == 4
        assert engine.writer.backlog == 2 and not engine.writer.behind
        assert outcomes(engine) == {"lost": 2.0}
        assert await engine.settle_writes(0.1) == 2  # still waiting to be written again

    with caplog.at_level("WARNING", logger="advantage_service.stats_writer"):
        run_engine(
            scenario, store, stats_max_backlog=2, queue_timeout_seconds=1.0, stats_retry_seconds=30
        )
    lines = [r.getMessage() for r in caplog.records]
    assert sum("more than 2 requests wait" in line for line in lines) == 2, lines
    assert any("'w0'" in line for line in lines) and any("'w1'" in line for line in lines)


class GatedRedis(RedisStatsStore):
    """A real Redis store whose first write waits until the test opens ``gate`` (so that the
    test can stop Redis between the answer and the write)."""

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        self.gate = asyncio.Event()

    async def record_write(self, write: Any) -> Any:
        await self.gate.wait()
        return await super().record_write(write)


def gated_engine(url: str) -> tuple[Engine, GatedRedis]:
    """An engine over a :class:`GatedRedis` at ``url`` whose writes time out after 0.3 s (the
    gate closed: the test opens it)."""
    metrics = Metrics(process=False)
    store = GatedRedis(
        url,
        write_timeout=0.3,
        on_error=lambda op: metrics.stats_store_errors_total.labels(op).inc(),
    )
    engine, _ = engine_with(store, metrics)
    return engine, store


@pytest.mark.integration
def test_a_write_to_a_stopped_redis_is_made_again_once_it_answers(
    redis_server: RedisServer,
) -> None:
    """A real Redis stopped (SIGSTOP) between the answer and its write: the write misses its
    timeout, the store backs off, and the request's statistics are written once Redis answers
    again, counted once (whether or not the write that timed out was applied when Redis woke)."""

    async def scenario() -> None:
        engine, store = gated_engine(redis_server.url)
        assert redis_server.process is not None
        try:
            answer = await compute(engine, 1, request_id="across-a-pause", history=False)
            assert answer.summary["recorded"] is True
            os.kill(redis_server.process.pid, signal.SIGSTOP)
            try:
                store.gate.set()
                await asyncio.sleep(1.5)
                assert engine.writer.backlog == 1  # not given up
            finally:
                os.kill(redis_server.process.pid, signal.SIGCONT)
            assert await engine.settle_writes(20) == 0
            assert store_errors(engine).get("record", 0) >= 1  # (the write did time out)
            assert await rollouts_counted(store) == ROLLOUTS
            assert outcomes(engine) in ({"counted": 1.0}, {"duplicate": 1.0}), outcomes(engine)
        finally:
            engine.close()
            await store.close()

    asyncio.run(scenario())


def test_shutting_down_answers_recorded_false_and_counts_what_it_could_not_write() -> None:
    store = HeldStore()

    async def scenario(engine: Engine, _: Counting) -> None:
        assert (await compute(engine, 1)).summary["recorded"] is True
        await engine.writer.flush(timeout=0.2)  # the held write never finishes
        late = await compute(engine, 2)
        assert late.summary["recorded"] is False
        assert outcomes(engine) == {"lost": 1.0, "refused": 1.0}

    run_engine(scenario, store)


def test_the_in_process_api_records_nothing() -> None:
    from advantage_service import compute as compute_in_process

    assert compute_in_process(body(1), device="cpu")["summary"]["recorded"] is None
