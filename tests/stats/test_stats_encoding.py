"""The numpy RESP encoder of the Redis store writes exactly what redis-py would."""

from __future__ import annotations

import numpy as np
import pytest
from advantage_service.stats.redis_store import _command, _records, _Text
from redis.asyncio.connection import Connection


def packed(*args: bytes) -> bytes:
    return b"".join(Connection().pack_command(*args))


@pytest.mark.parametrize("seed", range(5))
def test_integer_bulks_match_redis_py(seed: int) -> None:
    rng = np.random.default_rng(seed)
    edge = [0, 1, 9, 10, 99, 100, 151_935, 2**31 - 1, 10**18, -1, -10, -(10**18)]
    values = np.concatenate([edge, rng.integers(-(10**15), 10**15, 500), rng.integers(0, 10, 50)])
    rng.shuffle(values)
    tail = _records(_Text.integers(values).bulk())
    args = [b"%d" % v for v in values.tolist()]
    assert _command(b"HMGET", b"key", tail=tail, tail_args=len(args)) == packed(
        b"HMGET", b"key", *args
    )


def test_field_value_pairs_with_binary_values_match_redis_py() -> None:
    rng = np.random.default_rng(1)
    tokens = np.sort(rng.choice(200_000, 300, replace=False))
    rows = rng.normal(size=(300, 5))
    values = np.ascontiguousarray(rows, "<f8").view(np.uint8).reshape(-1, 40)
    parts = _Text.integers(tokens).bulk() + _Text.raw(values).bulk()
    pairs = [
        x for t, r in zip(tokens.tolist(), rows, strict=True) for x in (b"%d" % t, r.tobytes())
    ]
    assert _command(b"HSET", b"h", tail=_records(parts), tail_args=600) == packed(
        b"HSET", b"h", *pairs
    )


def test_float_increments_parse_back_to_the_values() -> None:
    values = np.array([0.1, -2.5, 1e-9, 3.0, 123456.789, -0.0, 7e-20])
    text = _records(_Text.floats(values).bulk())
    args = text.split(b"\r\n")[1::2]
    parsed = np.array([float(a) for a in args])
    assert parsed == pytest.approx(values, rel=1e-14, abs=1e-15 * 123456.789)


def test_empty_tails() -> None:
    empty = np.zeros(0, np.int64)
    assert _records(_Text.integers(empty).bulk()) == b""
    assert _command(b"PING") == packed(b"PING")
