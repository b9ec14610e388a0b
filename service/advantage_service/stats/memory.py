"""The embedded stats store: one process, in memory, the default without ``--redis-url``.

It keeps the same stored representation as the Redis store (rows with the lazy-decay clock, see
base.py) and goes through the same HistoryPrior code, so both backends give the same numbers.
Every entry expires ``ttl_seconds`` after its last write, as Redis keys do.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .base import (
    ROW_FIELDS,
    HistoryPrior,
    HistoryQuery,
    StatsUpdate,
    StoreStatus,
    TokenStatsUpdate,
    check_order,
    token_stats_response,
)

DEFAULT_TTL_SECONDS = 7 * 24 * 3600
TOKEN_COLUMNS = (
    "correct",
    "wrong",
    "occurrences",
    "key_sum",
    "key_count",
    "sens_sum",
    "sens_count",
)
INT_COLUMNS = frozenset({"correct", "wrong", "occurrences", "key_count", "sens_count"})


@dataclass
class _PromptHistory:
    expires: float
    totals: np.ndarray  # float64 (5,)
    tokens: np.ndarray  # int64 (M,) ascending
    rows: np.ndarray  # float64 (M, 5)


@dataclass
class _TokenTable:
    expires: float
    rollouts: int = 0
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    columns: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in TOKEN_COLUMNS:
            self.columns.setdefault(
                name, np.zeros(0, np.int64 if name in INT_COLUMNS else np.float64)
            )


class MemoryStatsStore:
    """The in-memory :class:`~advantage_service.stats.base.StatsStore`."""

    def __init__(
        self, ttl_seconds: float = DEFAULT_TTL_SECONDS, *, now: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_seconds = ttl_seconds
        self._now = now
        self._history: dict[tuple[str, str], _PromptHistory] = {}
        self._tokens: dict[str, _TokenTable] = {}
        self._requests: dict[tuple[str, str], float] = {}
        self._next_sweep = 0.0

    @property
    def status(self) -> StoreStatus:
        return "memory"

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._history.clear()
        self._tokens.clear()
        self._requests.clear()

    # ---- history ------------------------------------------------------------------------------

    async def read_history(self, namespace: str, query: HistoryQuery) -> HistoryPrior | None:
        now = self._now()
        totals = np.zeros((len(query.prompt_ids), ROW_FIELDS), np.float64)
        rows = np.zeros((query.tokens.size, ROW_FIELDS), np.float64)
        for g, prompt in enumerate(query.prompt_ids):
            stored = self._history.get((namespace, prompt))
            if stored is None or stored.expires <= now:
                continue
            totals[g] = stored.totals
            want = query.tokens_of(g)
            if not want.size or not stored.tokens.size:
                continue
            idx = np.searchsorted(stored.tokens, want).clip(max=stored.tokens.size - 1)
            found = stored.tokens[idx] == want
            start = int(query.offsets[g])
            rows[start : start + want.size][found] = stored.rows[idx[found]]
        return HistoryPrior.from_stored(totals, query.offsets, query.tokens, rows)

    def _write_history(self, namespace: str, update: StatsUpdate, expires: float) -> None:
        history = update.history
        if history is None:
            return
        for g, prompt in enumerate(history.prompt_ids):
            lo, hi = int(history.offsets[g]), int(history.offsets[g + 1])
            tokens, rows = history.tokens[lo:hi], history.rows[lo:hi]
            stored = self._history.get((namespace, prompt))
            if stored is not None and stored.expires > self._now():
                # Rows of tokens this visit did not contain stay as they are (lazy decay).
                kept = ~np.isin(stored.tokens, tokens)
                tokens = np.concatenate([stored.tokens[kept], tokens])
                rows = np.concatenate([stored.rows[kept], rows])
                order = np.argsort(tokens, kind="stable")
                tokens, rows = tokens[order], rows[order]
            self._history[(namespace, prompt)] = _PromptHistory(
                expires, history.totals[g].copy(), tokens.copy(), rows.copy()
            )

    # ---- token statistics --------------------------------------------------------------------

    def _write_tokens(self, namespace: str, update: TokenStatsUpdate, expires: float) -> None:
        table = self._tokens.get(namespace)
        if table is None or table.expires <= self._now():
            table = _TokenTable(expires)
        tokens, dense = np.unique(
            np.concatenate([table.tokens, update.tokens]), return_inverse=True
        )
        for name in TOKEN_COLUMNS:
            values = np.concatenate([table.columns[name], getattr(update, name)])
            summed = np.bincount(dense, weights=values, minlength=tokens.size)
            table.columns[name] = (
                np.rint(summed).astype(np.int64) if name in INT_COLUMNS else summed
            )
        table.tokens = tokens
        table.rollouts += int(update.rollouts)
        table.expires = expires
        self._tokens[namespace] = table

    async def token_stats(self, namespace: str, order: str, limit: int) -> dict[str, Any] | None:
        check_order(order)
        table = self._tokens.get(namespace)
        if table is None or table.expires <= self._now():
            table = _TokenTable(0.0)
        columns = {"token_id": table.tokens, **table.columns}
        return token_stats_response(namespace, table.rollouts, columns, order, limit)

    # ---- one request's writes ------------------------------------------------------------------

    async def record(self, namespace: str, request_id: str | None, update: StatsUpdate) -> bool:
        now = self._now()
        self._sweep(now)
        if request_id is not None:
            key = (namespace, request_id)
            if self._requests.get(key, 0.0) > now:
                return False
            self._requests[key] = now + self.ttl_seconds
        expires = now + self.ttl_seconds
        self._write_history(namespace, update, expires)
        self._write_tokens(namespace, update.tokens, expires)
        return True

    def _sweep(self, now: float) -> None:
        """Drop expired entries, at most every quarter TTL (a minute at most)."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + min(60.0, self.ttl_seconds / 4)
        self._history = {k: v for k, v in self._history.items() if v.expires > now}
        self._tokens = {k: v for k, v in self._tokens.items() if v.expires > now}
        self._requests = {k: t for k, t in self._requests.items() if t > now}


__all__ = ["DEFAULT_TTL_SECONDS", "MemoryStatsStore"]
