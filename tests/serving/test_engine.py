"""The engine (data plane) without a server: same numbers as the in-process API, limits,
admission without queueing, compute off the event loop, metrics, and the settings it runs on."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import threading
from typing import Any

import httpx
import numpy as np
import pytest
from advantage_service import LimitExceeded, RequestError, compute
from advantage_service.config import Settings
from advantage_service.errors import Overloaded
from advantage_service.observability.metrics import BulkHistogram, Metrics
from advantage_service.serving.compute import compute_request
from advantage_service.serving.engine import Engine
from advantage_service.transports import arrow
from advantage_service.transports.http import create_app
from advantage_service.transports.server import settings_from_args
from advantage_service.wire.request import parse_request
from oracle import PRESETS, random_request, reference_compute
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families


def make_request(groups: int = 3, size: int = 4, length: int = 20, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "estimator": "ktae",
        "return": ["scalar", "ktae_score"],
        "groups": [
            {
                "id": f"g{g}",
                "rollouts": [
                    {
                        "tokens": rng.integers(0, 300, size=int(rng.integers(0, length))).tolist(),
                        "reward": float(rng.integers(0, 2)),
                    }
                    for _ in range(size)
                ],
            }
            for g in range(groups)
        ],
    }


def engine_with(**overrides: Any) -> Engine:
    return Engine(Settings(device="cpu", **overrides), Metrics(process=False))


def samples(engine: Engine) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = engine.metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_engine_gives_the_in_process_api_numbers() -> None:
    """The engine's advantages are the in-process API's, bit for bit; and its advantages,
    scalars and KTAE scores are the reference implementation's (tests/oracle.py, written from
    ESTIMATORS.md and sharing no code with the service) to float32 rounding."""
    engine = engine_with()
    request = make_request()
    computed = asyncio.run(engine.compute(parse_request(request), "test"))
    result = computed.result
    bounds = computed.request.batch.offsets.numpy()[1:-1]
    got = np.split(result.advantages.numpy(), bounds)
    got_scores = np.split(result.diagnostics["ktae_score"].numpy(), bounds)
    api = [r for g in compute(request, device="cpu")["groups"] for r in g["rollouts"]]
    ref = [r for g in reference_compute(request)["groups"] for r in g["rollouts"]]
    # The request exercises both the outcome and the key-token term.
    assert any(r["scalar"] != 0 for r in ref)
    assert any(np.any(r["ktae_score"] != 0) for r in ref)
    tol = {"rtol": 2e-5, "atol": 2e-5}
    for advantages, scores, scalar, from_api, want in zip(
        got, got_scores, result.scalars.numpy(), api, ref, strict=True
    ):
        np.testing.assert_array_equal(advantages, from_api["advantages"])
        np.testing.assert_allclose(advantages, want["advantages"], **tol)
        np.testing.assert_allclose(scores, want["ktae_score"], **tol)
        np.testing.assert_allclose(scalar, want["scalar"], **tol)
    assert computed.summary["history"] == "none"
    assert computed.summary["tokens"] == sum(len(r["advantages"]) for r in ref)
    engine.close()


def test_engine_decodes_and_encodes_off_the_event_loop_thread() -> None:
    engine = engine_with()
    request = make_request()
    threads: dict[str, int] = {}

    def decode() -> Any:
        threads["decode"] = threading.get_ident()
        return parse_request(request)

    def encode(req: Any, result: Any, summary: dict[str, Any]) -> int:
        threads["encode"] = threading.get_ident()
        return int(summary["rollouts"])

    async def scenario() -> Any:
        threads["loop"] = threading.get_ident()
        return await engine.compute(decode, "test", encode=encode)

    computed = asyncio.run(scenario())
    assert computed.encoded == 12  # the encoder's answer: it ran
    assert threads.keys() == {"loop", "decode", "encode"}
    assert threads["decode"] != threads["loop"]
    assert threads["encode"] != threads["loop"]
    engine.close()


def test_token_limit_is_exact() -> None:
    request = make_request(groups=1, size=2, length=50, seed=3)
    tokens = sum(len(r["tokens"]) for r in request["groups"][0]["rollouts"])
    asyncio.run(engine_with(max_request_tokens=tokens).compute(parse_request(request), "t"))
    with pytest.raises(LimitExceeded) as info:
        asyncio.run(engine_with(max_request_tokens=tokens - 1).compute(parse_request(request), "t"))
    assert (info.value.status, info.value.field) == (413, "tokens")


def test_group_size_limit_names_the_group() -> None:
    request = make_request(groups=2, size=3)
    request["groups"][1]["rollouts"].append({"tokens": [1], "reward": 0.0})
    engine = engine_with(max_group_size=3)
    with pytest.raises(LimitExceeded) as info:
        asyncio.run(engine.compute(parse_request(request), "t"))
    assert (info.value.group_id, info.value.field) == ("g1", "rollouts")
    key = (
        "advantage_requests_total",
        (("code", "413"), ("estimator", "grpo+ktae"), ("transport", "t")),
    )
    assert samples(engine)[key] == 1


def test_admission_refuses_beyond_max_queue_with_a_retry_hint() -> None:
    engine = engine_with(max_queue=2)
    first, second = engine.admit(), engine.admit()
    with pytest.raises(Overloaded) as info:
        engine.admit()
    assert (info.value.status, info.value.code) == (503, "overloaded")
    assert info.value.retry_after_ms >= 10 and info.value.retry_after_seconds >= 1
    assert info.value.to_dict()["retry_after_ms"] == info.value.retry_after_ms
    with pytest.raises(Overloaded):
        asyncio.run(engine.compute(parse_request(make_request()), "t"))
    assert engine.inflight == 2
    assert samples(engine)[("advantage_inflight_requests", ())] == 2
    first.release()
    first.release()  # releasing twice frees one place, not two
    third = engine.admit()
    with pytest.raises(Overloaded):
        engine.admit()
    second.release()
    third.release()
    assert engine.inflight == 0
    assert samples(engine)[("advantage_inflight_requests", ())] == 0
    key = (
        "advantage_requests_total",
        (("code", "503"), ("estimator", "unknown"), ("transport", "t")),
    )
    assert samples(engine)[key] == 1  # (the direct admits are the transport's to count)
    asyncio.run(engine.compute(parse_request(make_request()), "t"))


def test_a_failed_decode_releases_its_slot_and_is_counted() -> None:
    engine = engine_with(max_inflight=1)

    def decode() -> Any:
        return parse_request({"groups": "nope"})

    for _ in range(3):
        with pytest.raises(RequestError):
            asyncio.run(engine.compute(decode, "t"))
    assert engine.inflight == 0
    key = ("advantage_request_errors_total", (("error", "invalid_type"), ("transport", "t")))
    assert samples(engine)[key] == 3


def test_event_loop_keeps_running_while_a_batch_computes() -> None:
    """The compute is held until the event loop has ticked a few times: it can only finish if
    it runs off the loop (on the loop it would wait for ticks that never come)."""
    req = parse_request(make_request(groups=4, size=4, length=50, seed=1))
    ticked = threading.Event()

    def held_compute(*args: Any, **kwargs: Any) -> Any:
        assert ticked.wait(timeout=30), "the event loop did not run while computing"
        return compute_request(*args, **kwargs)

    engine = Engine(Settings(device="cpu"), Metrics(process=False), compute=held_compute)

    async def scenario() -> int:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.001)
                ticks += 1
                if ticks >= 3:
                    ticked.set()

        task = asyncio.create_task(ticker())
        await engine.compute(req, "t")
        task.cancel()
        return ticks

    assert asyncio.run(scenario()) >= 3
    engine.close()


def test_non_finite_results_are_refused_and_located() -> None:
    request = make_request(groups=2, size=2, length=5, seed=4)
    request["estimator"] = {"outcome": "grpo", "opsd": {"coef": 1e308}}
    request["return"] = []
    for group in request["groups"]:
        for rollout in group["rollouts"]:
            n = len(rollout["tokens"])
            rollout["logprobs"] = [-1.0] * n
            rollout["teacher_logprobs"] = {"pos": [-0.5] * n}
    request["groups"][0]["rollouts"][0]["tokens"] = []  # the first bad token is in rollout 1
    request["groups"][0]["rollouts"][0]["logprobs"] = []
    request["groups"][0]["rollouts"][0]["teacher_logprobs"] = {"pos": []}
    request["groups"][0]["rollouts"][1]["tokens"] = [5]
    request["groups"][0]["rollouts"][1]["logprobs"] = [-1.0]
    request["groups"][0]["rollouts"][1]["teacher_logprobs"] = {"pos": [-0.5]}
    with pytest.raises(RequestError) as info:
        asyncio.run(engine_with().compute(parse_request(request), "t"))
    error = info.value
    assert (error.code, error.status, error.field) == ("non_finite_result", 422, "estimator")
    assert (error.group_id, error.rollout_index) == ("g0", 1)


def test_metrics_count_groups_by_signal_and_accuracy() -> None:
    engine = engine_with()
    request = {
        "estimator": "grpo",
        "groups": [
            {"id": "same", "rollouts": [{"tokens": [1], "reward": 1.0}] * 3},
            {"id": "mixed", "rollouts": [{"tokens": [1, 2], "reward": r} for r in (1, 0, 0, 0)]},
        ],
    }
    asyncio.run(engine.compute(parse_request(request), "t"))
    s = samples(engine)
    assert s[("advantage_groups_total", (("signal", "zero"),))] == 1
    assert s[("advantage_groups_total", (("signal", "nonzero"),))] == 1
    assert s[("advantage_group_accuracy_bucket", (("le", "0.2"),))] == 0
    assert s[("advantage_group_accuracy_bucket", (("le", "0.3"),))] == 1
    assert s[("advantage_group_accuracy_bucket", (("le", "1.0"),))] == 2
    assert s[("advantage_tokens_total", (("estimator", "grpo"),))] == 11
    assert s[("advantage_token_advantage_count", (("estimator", "grpo"),))] == 11


def test_bulk_histogram_counts_like_prometheus_histogram() -> None:
    # prometheus_client's own Histogram, one observe() per value, is the oracle.
    buckets = (-1.0, -0.1, 0.0, 0.1, 1.0)
    values = np.concatenate(
        [np.random.default_rng(0).normal(0, 1, 500), [-1.0, -0.1, 0.0, 0.1, 1.0, 5.0, np.nan]]
    )
    registry = CollectorRegistry()
    bulk = BulkHistogram("bulk", "b", buckets, ["k"], registry=registry)
    oracle = Histogram("oracle", "o", ["k"], buckets=buckets, registry=registry)
    bulk.observe_many(values[:300], "x")
    bulk.observe_many(values[300:], "x")
    for v in values[~np.isnan(values)]:
        oracle.labels("x").observe(v)
    got = {
        s.labels["le"]: s.value
        for s in next(f for f in registry.collect() if f.name == "bulk").samples
        if s.name == "bulk_bucket"
    }
    want = {
        s.labels["le"]: s.value
        for s in next(f for f in registry.collect() if f.name == "oracle").samples
        if s.name == "oracle_bucket"
    }
    assert got == want


def test_readyz_is_503_while_warming_up_and_while_draining() -> None:
    engine = engine_with()
    app = create_app(engine.settings, engine)

    async def readyz() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/readyz")

    cold = asyncio.run(readyz())
    assert (cold.status_code, cold.json()["reason"]) == (503, "warming up")
    engine.warm_up()
    assert asyncio.run(readyz()).status_code == 200
    engine.draining = True
    draining = asyncio.run(readyz())
    assert (draining.status_code, draining.json()["reason"]) == (503, "draining")
    engine.close()


def test_cli_flags_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADV_HTTP_PORT", "9001")
    monkeypatch.setenv("ADV_MAX_INFLIGHT", "7")
    monkeypatch.setenv("ADV_DEVICE", "cuda")
    args = argparse.Namespace(
        host=None, http_port=9002, grpc_port=None, device="cpu", redis_url=None, log_level=None
    )
    settings = settings_from_args(args)
    assert (settings.http_port, settings.device) == (9002, "cpu")
    assert settings.max_inflight == 7
    assert settings.grpc_port == 50051


def test_arrow_request_table_round_trips_to_the_same_batch() -> None:
    req = parse_request(make_request(groups=4, size=3, length=30, seed=8))
    table = arrow.request_table(req.batch, {"estimator": "grpo"})
    decoded = arrow.decode_request(arrow.write_stream(table))
    batch, again = req.batch, decoded.batch
    assert again.group_ids == batch.group_ids
    for name in ("tokens", "offsets", "group_index", "rewards"):
        np.testing.assert_array_equal(getattr(again, name).numpy(), getattr(batch, name).numpy())
    assert decoded.estimator.label == "grpo"


@pytest.mark.parametrize(
    "estimator",
    [*PRESETS, {"outcome": "rloo", "ktae": {}, "cscr": {}, "opsd": {}, "whiten": True}],
    ids=str,
)
def test_arrow_requests_are_computed_without_writing_to_their_buffers(estimator: Any) -> None:
    """Arrow columns reach the estimators as read-only views of the request body (no copy):
    every estimator must leave them as they were."""
    body = random_request(
        np.random.default_rng(21),
        estimator=estimator,
        n_groups=(3, 5),
        length=(0, 40),
        logprobs=True,
        teachers=("pos", "neg"),
    )
    req = parse_request(body)
    payload = bytes(arrow.write_stream(arrow.request_table(req.batch, {"estimator": estimator})))
    before = hashlib.sha256(payload).hexdigest()
    decoded = arrow.decode_request(payload)
    start = np.frombuffer(payload, np.uint8).ctypes.data
    batch = decoded.batch
    columns = {"tokens": batch.tokens, "logprobs": batch.logprobs, **batch.teacher_logprobs}
    views = [
        name
        for name, column in columns.items()
        if column is not None and start <= column.data_ptr() < start + len(payload)
    ]
    assert {"logprobs", "pos", "neg"} <= set(views), f"zero-copy columns: {views}"
    compute_request(decoded, "cpu")
    assert hashlib.sha256(payload).hexdigest() == before


def test_the_servers_ignore_token_ids_apply_to_requests_that_give_none() -> None:
    """ADV_IGNORE_TOKEN_IDS reaches the computation: a KTAE key token the server ignores scores
    0 in a request without its own list, and keeps its score in one that gives another list."""
    request = {
        "estimator": "ktae",
        "return": ["ktae_score"],
        "groups": [
            {
                "id": "g",
                "rollouts": [
                    {"tokens": [7, 1], "reward": 1.0},
                    {"tokens": [2, 1], "reward": 0.0},
                ],
            }
        ],
    }
    engine = engine_with(ignore_token_ids=(7,))
    plain = asyncio.run(engine.compute(parse_request(request), "t"))
    own = asyncio.run(engine.compute(parse_request({**request, "ignore_token_ids": [2]}), "t"))
    scores = plain.result.diagnostics["ktae_score"].tolist()
    assert scores[0] == 0.0 and scores[2] != 0.0  # 7 ignored by the server, 2 scored
    own_scores = own.result.diagnostics["ktae_score"].tolist()
    assert own_scores[0] != 0.0 and own_scores[2] == 0.0  # the request's own list instead
    engine.close()


def test_an_answer_is_encoded_before_later_requests_are_decoded() -> None:
    """One codec thread, busy decoding request B while request A computes, with C's body
    waiting: when A is computed its answer is encoded before C is decoded (A's statistics are
    accepted and its client waits; C has not started)."""
    ran: list[str] = []
    computing, compute_release, decode_release = (threading.Event() for _ in range(3))

    def held_compute(*args: Any, **kwargs: Any) -> Any:
        if not computing.is_set():  # (A's computation only)
            computing.set()
            assert compute_release.wait(30)
        return compute_request(*args, **kwargs)

    engine = Engine(
        Settings(device="cpu", max_inflight=1), Metrics(process=False), compute=held_compute
    )

    def decoder(name: str, hold: threading.Event | None = None) -> Any:
        def decode() -> Any:
            if hold is not None:
                assert hold.wait(30)
            ran.append(f"decode {name}")
            return parse_request(make_request(seed=len(name)))

        return decode

    def encoder(name: str) -> Any:
        def encode(req: Any, result: Any, summary: dict[str, Any]) -> None:
            ran.append(f"encode {name}")

        return encode

    async def scenario() -> None:
        async def send(name: str, hold: threading.Event | None = None) -> Any:
            return await engine.compute(decoder(name, hold), "t", encode=encoder(name))

        a = asyncio.create_task(send("A"))
        while not computing.is_set():
            await asyncio.sleep(0.005)
        b = asyncio.create_task(send("B", decode_release))
        c = asyncio.create_task(send("C"))
        while engine._codecs.pending < 1:  # C's decoding waits behind B's
            await asyncio.sleep(0.005)
        compute_release.set()  # A computes; its encoding waits behind B's decoding too
        while engine._codecs.pending < 2:
            await asyncio.sleep(0.005)
        decode_release.set()
        await asyncio.gather(a, b, c)

    asyncio.run(scenario())
    assert ran[:3] == ["decode A", "decode B", "encode A"]
    # (then C's decoding and B's encoding, in whichever order B's computation allows: B's
    # answer, once computed, goes first too, and a loaded machine may finish it before the
    # codec thread takes C's body)
    assert sorted(ran[3:]) == ["decode C", "encode B", "encode C"]
    assert ran.index("decode C") < ran.index("encode C")
    engine.close()


def test_past_the_refusal_point_a_request_not_yet_decoded_is_refused_without_decoding() -> None:
    """A shutdown deadline near (the scheduler refuses every request that would wait): a
    request whose body waits for a codec thread is answered 503 with a retry hint, its body
    never parsed (it could not be answered in time); the one being decoded is computed."""
    engine = engine_with(max_inflight=1)
    hold, holding = threading.Event(), threading.Event()
    decoded: list[str] = []

    def decoder(name: str) -> Any:
        def decode() -> Any:
            if name == "A":
                holding.set()
                assert hold.wait(30)
            decoded.append(name)
            return parse_request(make_request())

        return decode

    async def scenario() -> list[Any]:
        a = asyncio.create_task(engine.compute(decoder("A"), "t"))
        while not holding.is_set():
            await asyncio.sleep(0.005)
        b = asyncio.create_task(engine.compute(decoder("B"), "t"))
        while engine._codecs.pending < 1:
            await asyncio.sleep(0.005)
        engine.scheduler.refuse_waiting("the service is shutting down")
        hold.set()
        return await asyncio.gather(a, b, return_exceptions=True)

    a, b = asyncio.run(scenario())
    assert decoded == ["A"]
    assert a.summary["rollouts"] == 12
    assert isinstance(b, Overloaded) and b.status == 503, b
    assert "shutting down" in str(b) and b.retry_after_seconds >= 1
    assert engine.inflight == 0
    engine.close()
