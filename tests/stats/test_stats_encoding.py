"""The stored records (``stats.blobs``, ``estimators.ktae_history``) and the Redis store's RESP
encoder, checked against simple implementations: per-token dictionaries and redis-py's own
command packer."""

from __future__ import annotations

import numpy as np
import pytest
from advantage_service.estimators.ktae_history import (
    PRUNE_BELOW,
    PromptHistory,
    decode_history,
    encode_history,
    is_compressed,
    merge_history,
)
from advantage_service.stats.blobs import (
    TokenStatsUpdate,
    decode_token_stats,
    encode_token_stats,
    merge_token_stats,
)
from advantage_service.stats.redis_common import command as _command
from redis.asyncio.connection import Connection

COLUMNS = ("correct", "wrong", "occurrences", "key_sum", "key_count", "sens_sum", "sens_count")


def packed(*args: bytes) -> bytes:
    return b"".join(Connection().pack_command(*args))


def test_commands_match_redis_py_with_small_and_megabyte_arguments() -> None:
    big = np.random.default_rng(0).bytes(3 << 20)
    for args in [
        (b"PING",),
        (b"GET", b"k"),
        (b"SET", b"key", big, b"PX", b"60000"),
        (b"EVAL", b"return 1", b"2", b"a", b"b", big, big[:100], b""),
    ]:
        assert b"".join(_command(*args)) == packed(*args)
    # Megabyte arguments stay their own buffer: never copied into the command.
    assert any(chunk is big for chunk in _command(b"SET", b"key", big))


def random_history(rng: np.random.Generator, rows: int, vocab: int = 200_000) -> PromptHistory:
    tokens = np.sort(rng.choice(vocab, rows, replace=False)).astype(np.int32)
    values = rng.uniform(0, 8, size=(rows, 4)).astype(np.float32)
    return PromptHistory(rng.uniform(0, 40, 4), tokens, values)


@pytest.mark.parametrize("rows", [0, 1, 1000])
def test_history_records_round_trip(rows: int) -> None:
    history = random_history(np.random.default_rng(rows), rows)
    blob = encode_history(history)
    assert len(blob) == 48 + 20 * rows
    back = decode_history(blob)
    assert back is not None
    assert np.array_equal(back.totals, history.totals)
    assert np.array_equal(back.tokens, history.tokens)
    assert np.array_equal(back.values, history.values)


@pytest.mark.parametrize("rows", [0, 1, 1000, 60_000])
def test_compressed_history_records_round_trip_and_shrink(rows: int) -> None:
    rng = np.random.default_rng(rows + 1)
    history = random_history(rng, rows, vocab=2**31 - 1 if rows == 1000 else 152_000)
    if rows == 60_000:  # what stored history looks like: decayed dyadic counts
        history.values[:] = rng.integers(0, 4, size=(rows, 4)) * 0.5 ** rng.integers(
            0, 10, (rows, 1)
        )
    blob = encode_history(history, compress=True)
    assert is_compressed(blob) and not is_compressed(encode_history(history))
    back = decode_history(blob)
    assert back is not None
    assert back.tokens.dtype == np.int32 and back.values.dtype == np.float32
    assert np.array_equal(back.totals, history.totals)
    assert np.array_equal(back.tokens, history.tokens)
    assert np.array_equal(back.values, history.values)
    if rows == 60_000:
        assert len(blob) < 20 * rows / 5, f"{20 * rows / len(blob):.1f}x"


def test_foreign_or_truncated_records_read_as_absent() -> None:
    blob = encode_history(random_history(np.random.default_rng(1), 10))
    stats = encode_token_stats(token_update(np.random.default_rng(1), 10))
    packed = encode_history(random_history(np.random.default_rng(2), 10), compress=True)
    wrong_rows = packed[:8] + (11).to_bytes(8, "little") + packed[16:]
    for junk in [
        *[None, b"", b"hello", blob[:-1], blob + b"x", b"XXXX" + blob[4:], stats],
        *[packed[:-1], packed[:60] + b"garbage" + packed[67:], wrong_rows],
    ]:
        assert decode_history(junk) is None
    for junk in [None, b"", stats[:-1], stats + b"xyzw", blob]:
        assert decode_token_stats(junk) is None


def merge_by_dict(
    stored: PromptHistory | None,
    totals: np.ndarray,
    tokens: np.ndarray,
    values: np.ndarray,
    decay: float,
) -> dict[int, np.ndarray]:
    rows: dict[int, np.ndarray] = {}
    if stored is not None:
        for t, v in zip(stored.tokens.tolist(), stored.values, strict=True):
            rows[t] = v.astype(np.float64)
    for t, v in zip(tokens.tolist(), values, strict=True):
        rows[t] = rows.get(t, np.zeros(4)) + v
    return {t: decay * v for t, v in rows.items() if decay * v.sum() >= PRUNE_BELOW}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("decay", [0.5, 0.3, 0.0])
def test_history_merge_equals_a_per_token_merge(seed: int, decay: float) -> None:
    rng = np.random.default_rng(seed)
    stored = None if seed == 0 else random_history(rng, int(rng.integers(0, 400)), vocab=600)
    if stored is not None and seed % 2:
        stored.values[rng.random(stored.rows) < 0.3] *= 1e-4  # some rows to prune
    tokens = np.sort(rng.choice(600, int(rng.integers(0, 300)), replace=False)).astype(np.int64)
    values = rng.integers(0, 6, size=(tokens.size, 4)).astype(np.float64)
    totals = rng.uniform(0, 30, 4)
    merged = merge_history(stored, totals, tokens, values, decay)
    want = merge_by_dict(stored, totals, tokens, values, decay)
    assert merged.tokens.tolist() == sorted(want)
    assert merged.tokens.dtype == np.int32 and merged.values.dtype == np.float32
    for t, v in zip(merged.tokens.tolist(), merged.values, strict=True):
        assert v == pytest.approx(want[t].astype(np.float32), rel=1e-7)
    before = np.zeros(4) if stored is None else stored.totals
    assert merged.totals == pytest.approx(decay * (before + totals))


def test_pruning_drops_rows_below_the_threshold_after_decay() -> None:
    stored = PromptHistory(
        np.array([4.0, 4.0, 10.0, 10.0]),
        np.array([1, 2, 3], np.int32),
        np.array([[0, 0, 0, 0.0019], [0, 0, 0, 0.0021], [1, 0, 1, 0]], np.float32),
    )
    merged = merge_history(stored, np.zeros(4), np.zeros(0, np.int64), np.zeros((0, 4)), 0.5)
    # 0.0019 / 2 < 1e-3 goes, 0.0021 / 2 stays.
    assert merged.tokens.tolist() == [2, 3]


def token_update(rng: np.random.Generator, rows: int, vocab: int = 152_000) -> TokenStatsUpdate:
    tokens = np.sort(rng.choice(vocab, rows, replace=False)).astype(np.int64)
    ints = {c: rng.integers(0, 50, rows) for c in COLUMNS if "sum" not in c}
    floats = {c: rng.normal(size=rows) for c in COLUMNS if "sum" in c}
    return TokenStatsUpdate(int(rng.integers(1, 600)), tokens, **ints, **floats)


def as_dict(stats: TokenStatsUpdate) -> dict[int, tuple[float, ...]]:
    return {
        t: tuple(float(getattr(stats, c)[i]) for c in COLUMNS)
        for i, t in enumerate(stats.tokens.tolist())
    }


def test_token_statistics_records_round_trip_with_absent_columns_and_wide_counts() -> None:
    rng = np.random.default_rng(3)
    full = token_update(rng, 500)
    plain = token_update(rng, 300)
    plain.key_sum[:] = plain.sens_sum[:] = 0
    plain.key_count[:] = plain.sens_count[:] = 0
    wide = token_update(rng, 20)
    wide.occurrences[3] = 5 * 2**32
    for stats in (full, plain, wide, token_update(rng, 0)):
        blob = encode_token_stats(stats)
        back = decode_token_stats(blob)
        assert back is not None and back.rollouts == stats.rollouts
        assert as_dict(back) == as_dict(stats)
    # The columns a GRPO request lacks cost nothing; counts are 4 bytes unless they must be 8.
    assert len(encode_token_stats(plain)) == 24 + 300 * (4 * 3 + 4)
    assert len(encode_token_stats(full)) == 24 + 500 * (8 * 2 + 4 * 5 + 4)
    assert len(encode_token_stats(wide)) == 24 + 20 * (8 * 2 + 8 * 5 + 4)


@pytest.mark.parametrize("vocab", [152_000, 2**31 - 1])
def test_token_statistics_merge_equals_a_per_token_sum(vocab: int) -> None:
    rng = np.random.default_rng(vocab % 97)
    parts = [token_update(rng, int(rng.integers(0, 2000)), vocab) for _ in range(7)]
    merged = merge_token_stats(parts)
    want: dict[int, np.ndarray] = {}
    for part in parts:
        for t, row in as_dict(part).items():
            want[t] = want.get(t, np.zeros(len(COLUMNS))) + row
    assert merged.tokens.tolist() == sorted(want)
    assert merged.rollouts == sum(p.rollouts for p in parts)
    for t, row in as_dict(merged).items():
        assert row == pytest.approx(tuple(want[t]), rel=1e-12, abs=1e-12)
    assert merged.correct.dtype == np.int64 and merged.key_sum.dtype == np.float64
