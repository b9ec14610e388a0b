"""Rolling upgrades: replicas of the previous release and of this one share one Redis.

``fixtures/rolling_upgrade.json`` holds what the release before the stateful-term protocol wrote
to Redis for three requests and answered to a fourth (see ``fixtures/README.md``). This release
must (1) answer the fourth request from the old release's records exactly as the old release did,
and (2) write, for the same requests, the same keys and bytes the old release wrote, so that the
old release's replicas read this release's records (they read their own).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from advantage_service.config import Settings
from advantage_service.estimators.ktae_history import decode_history, is_compressed
from advantage_service.observability.metrics import Metrics
from advantage_service.serving.engine import Engine
from advantage_service.stats.blobs import decode_token_stats
from advantage_service.wire.request import parse_request
from redis_support import RedisServer

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

FIXTURES = json.loads((Path(__file__).parent / "fixtures" / "rolling_upgrade.json").read_text())


def load(client: redis.Redis, keys: dict[str, Any]) -> None:
    """Put the old release's keys into a fresh Redis (claims by name: their values are random)."""
    for key, entry in keys.items():
        if entry["type"] == "list":
            client.rpush(key, *(base64.b64decode(v) for v in entry["values"]))
        elif "value" in entry:
            client.set(key, base64.b64decode(entry["value"]))
        else:
            client.set(key, b"claimed")


def dump(client: redis.Redis) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for raw in sorted(client.keys("*")):
        key = raw.decode()
        kind = client.type(raw).decode()
        if ":claim:" in key or ":write:" in key:
            out[key] = {"type": kind}
        elif kind == "string":
            out[key] = {"type": kind, "value": base64.b64encode(client.get(raw)).decode()}
        else:
            values = client.lrange(raw, 0, -1)
            out[key] = {"type": kind, "values": [base64.b64encode(v).decode() for v in values]}
    return out


def assert_same_keys(got: dict[str, Any], want: dict[str, Any]) -> None:
    """The same keys; history records byte for byte (compressed ones: the same rows, since a
    zstd frame's bytes depend on the library's version); statistics records with the same
    counts and (float64 sums of scores) the same sums to rounding."""
    assert sorted(got) == sorted(want)
    for key, entry in want.items():
        assert got[key]["type"] == entry["type"], key
        if ":history:" in key:
            mine, theirs = (base64.b64decode(e["value"]) for e in (got[key], entry))
            if is_compressed(theirs):
                ours, old = decode_history(mine), decode_history(theirs)
                assert ours is not None and old is not None and is_compressed(mine), key
                for column in ("totals", "tokens", "values"):
                    assert np.array_equal(getattr(ours, column), getattr(old, column)), key
            else:
                assert mine == theirs, key
        elif "value" in entry or "values" in entry:
            mine = got[key].get("values") or [got[key]["value"]]
            theirs = entry.get("values") or [entry["value"]]
            assert len(mine) == len(theirs), key
            for a, b in zip(mine, theirs, strict=True):
                ours = decode_token_stats(base64.b64decode(a))
                old = decode_token_stats(base64.b64decode(b))
                assert ours is not None and old is not None, key
                assert ours.rollouts == old.rollouts
                for column in ("tokens", "correct", "wrong", "occurrences", "key_count"):
                    assert np.array_equal(getattr(ours, column), getattr(old, column)), column
                for column in ("key_sum", "sens_sum", "sens_count"):
                    np.testing.assert_allclose(
                        getattr(ours, column), getattr(old, column), rtol=1e-12, atol=1e-12
                    )


def floats(encoded: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(encoded), np.float32)


@pytest.fixture(params=["none", "zstd"])
def fixture(request: pytest.FixtureRequest) -> dict[str, Any]:
    return dict(FIXTURES[request.param])


async def engine_on(server: RedisServer, compression: str) -> Engine:
    settings = Settings(device="cpu", redis_url=server.url, stats_compression=compression)
    engine = Engine(settings, Metrics(process=False))
    await engine.start()
    return engine


async def test_this_release_answers_from_the_previous_releases_records(
    redis_server: RedisServer, fixture: dict[str, Any]
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    load(client, fixture["stored_after_3"])
    engine = await engine_on(redis_server, fixture["compression"])
    try:
        computed = await engine.compute(parse_request(fixture["requests"][3]), "test")
        await engine.settle_writes()
        want = fixture["answer_4"]
        assert computed.summary["history"] == want["summary_history"] == "applied"
        result = computed.result
        for got, name in (
            (result.advantages, "advantages"),
            (result.diagnostics["ktae_score"], "ktae_score"),
            (result.scalars, "scalars"),
        ):
            np.testing.assert_allclose(got.numpy(), floats(want[name]), rtol=1e-6, atol=1e-7)
        # History changed the answer: the fixture is not one a fresh store would give.
        assert float(np.abs(floats(want["ktae_score"])).sum()) > 0
        # What it wrote over the old records is what the old release wrote.
        assert_same_keys(dump(client), fixture["stored_after_4"])
    finally:
        await engine.flush()
        engine.close()
        client.close()


async def test_this_release_writes_the_records_the_previous_release_wrote(
    redis_server: RedisServer, fixture: dict[str, Any]
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    engine = await engine_on(redis_server, fixture["compression"])
    try:
        for body in fixture["requests"][:3]:
            await engine.compute(parse_request(body), "test")
            await engine.settle_writes()
        stored = dump(client)
        assert any(":history:" in key for key in stored)
        assert_same_keys(stored, fixture["stored_after_3"])
    finally:
        await engine.flush()
        engine.close()
        client.close()
