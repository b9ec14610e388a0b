"""Test helpers: one request through the service's state session, random requests, and a slow
oracle of KTAE with history (eager decay, per token, from the formulas) to check the fast path
against."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import oracle
import pytest
import torch
from advantage_service.estimators import AdvantageResult
from advantage_service.estimators.ktae_history import SPACE, HistoryPrior
from advantage_service.estimators.state import Compression, WriteOptions
from advantage_service.serving.compute import compute_request
from advantage_service.serving.term_state import PendingWrites, StateSession
from advantage_service.stats import StatsStore, StatsUpdate, TokenStatsUpdate
from advantage_service.stats.base import RecordKey, RequestWrite
from advantage_service.wire.request import ComputeRequest, parse_request


@dataclass
class Served:
    req: ComputeRequest
    result: AdvantageResult
    prior: HistoryPrior | None
    history: str  # none | applied | unavailable
    counted: bool
    update: StatsUpdate


async def serve(
    store: StatsStore, body: dict[str, Any], compression: Compression | None = None
) -> Served:
    """One request the way the engine runs it (its StateSession): read, compute, write.

    ``compression``: how records are written (default: the store fixture's, see conftest)."""
    req = parse_request(body)
    if compression is None:
        compression = getattr(store, "test_compression", "none")
    session = StateSession(store, req, torch.device("cpu"), WriteOptions(compression))
    # (on a worker thread, as in the engine: a term may wait there for the read on this loop)
    result = await asyncio.to_thread(compute_request, req, "cpu", session.context)
    history = await session.settle()
    update = session.update(result)
    counted = await session.record(update)
    read = session.context.reads.get("ktae")
    prior = read.result() if read is not None else None
    return Served(req, result, prior, history, counted, update)


class _Unreachable:
    """A store whose reads fail, as a Redis store's do while Redis is down."""

    async def read_records(self, namespace: str, keys: Any) -> None:
        return None

    async def read_partly(self, namespace: str, keys: Any, request_id: Any = None) -> None:
        return None

    @property
    def writable(self) -> bool:
        return False


def write_options(store: StatsStore) -> WriteOptions:
    """How the records of a test's requests are written (the store fixture's compression)."""
    return WriteOptions(getattr(store, "test_compression", "none"))


async def writes_of(store: StatsStore, body: dict[str, Any]) -> PendingWrites:
    """What one request writes after reading ``store`` now (not written)."""
    req = parse_request(body)
    session = StateSession(store, req, torch.device("cpu"), write_options(store))
    result = await asyncio.to_thread(compute_request, req, "cpu", session.context)
    assert await session.settle() in ("empty", "applied")
    return session.writes(result)


async def update_of(store: StatsStore, body: dict[str, Any], *, read: bool = True) -> StatsUpdate:
    """What a request would write (not written): after a successful read of ``store``, or after
    a read that failed (``read=False``)."""
    req = parse_request(body)
    source: Any = store if read else _Unreachable()
    session = StateSession(source, req, torch.device("cpu"))
    result = await asyncio.to_thread(compute_request, req, "cpu", session.context)
    await session.settle()
    return session.update(result)


async def read_history(
    store: StatsStore, namespace: str, prompts: list[str]
) -> HistoryPrior | None:
    """The key-token history prior of ``prompts`` as a request would read it (None: the store
    could not be read)."""
    records = await store.read_records(namespace, [(SPACE, p) for p in prompts])
    return None if records is None else HistoryPrior.decode(records, torch.device("cpu"))


# fold(keys, keep): the records of ``keys`` folded from the requests at positions ``keep``.
Fold = Callable[[frozenset[RecordKey], tuple[int, ...]], dict[RecordKey, bytes]]


async def record_folded(
    store: StatsStore,
    namespace: str,
    requests: Sequence[RequestWrite],
    update: StatsUpdate,
    fold: Fold | None = None,
) -> list[str]:
    """Hand ``update`` to the store as the service's writer does: the records it asks for
    folded again by ``fold`` (None: it must ask for none), until it is done; the outcomes."""
    recording = await store.record_requests(namespace, requests, update)
    while recording.again:
        assert fold is not None, f"the store asked for records again: {recording.again}"
        records: dict[RecordKey, bytes] = {}
        for ask in recording.again:
            records.update(fold(ask.keys, ask.keep))
        await recording.send(records)
    return list(recording.outcomes)


def assert_same_stored(first: HistoryPrior, second: HistoryPrior) -> None:
    """Two priors read the same stored history (totals, token ids and values) per prompt."""
    assert torch.equal(first.n_c, second.n_c) and torch.equal(first.len_w, second.len_w)
    for one, other in zip(first.stored, second.stored, strict=True):
        assert (one is None) == (other is None)
        if one is not None:
            assert np.array_equal(one.tokens, other.tokens)
            assert np.array_equal(one.values, other.values)


def assert_token_stats_are_the_sum(
    stats: dict[str, Any] | None, updates: list[TokenStatsUpdate]
) -> None:
    """``stats`` (a ``token_stats`` body, every token) holds the per-token sums of ``updates``,
    added up here one token at a time."""
    assert stats is not None
    assert stats["rollouts_counted"] == sum(u.rollouts for u in updates)
    names = ("correct", "wrong", "occurrences", "key_sum", "key_count", "sens_sum", "sens_count")
    sums: dict[int, dict[str, float]] = {}
    for update in updates:
        for i, token in enumerate(update.tokens.tolist()):
            row = sums.setdefault(token, dict.fromkeys(names, 0.0))
            for name in names:
                row[name] += float(getattr(update, name)[i])
    rows = {row["token_id"]: row for row in stats["tokens"]}
    assert sorted(rows) == sorted(sums)
    for token, want in sums.items():
        row = rows[token]
        assert row["correct_rollouts"] == want["correct"]
        assert row["wrong_rollouts"] == want["wrong"]
        assert row["occurrences"] == want["occurrences"]
        if want["key_count"]:
            key = want["key_sum"] / want["key_count"]
            assert row["key_score"] == pytest.approx(key, rel=1e-12, abs=1e-15)
        else:
            assert row["key_score"] is None
        if want["sens_count"]:
            sens = want["sens_sum"] / want["sens_count"]
            assert row["mean_sensitivity"] == pytest.approx(sens, rel=1e-12)
        else:
            assert row["mean_sensitivity"] is None


def table_scores(result: AdvantageResult) -> dict[tuple[int, int], float]:
    """(group, token id) -> the KTAE score the service computed (float64)."""
    tables = result.state["ktae"].tables
    score = result.state["ktae"].score
    return {
        (int(g), int(t)): float(s)
        for g, t, s in zip(
            tables.group.tolist(), tables.token.tolist(), score.tolist(), strict=True
        )
    }


KTAE_HISTORY = {"outcome": "grpo", "ktae": {"history": "prompt"}, "cscr": {}}


def history_body(namespace: str, seed: int, prompts: list[str], **extra: Any) -> dict[str, Any]:
    """A KTAE request with history (and CSCR) over ``prompts``, random groups of ``seed``."""
    rng = np.random.default_rng(seed)
    return {
        "namespace": namespace,
        "estimator": KTAE_HISTORY,
        "groups": random_groups(rng, prompts, teacher=True),
        **extra,
    }


def small_tokens(seed: int) -> TokenStatsUpdate:
    """A small statistics update of 2 rollouts over a few token ids of ``seed``."""
    rng = np.random.default_rng(seed)
    ids = np.unique(rng.integers(0, 50, size=10)).astype(np.int64)
    ones, zeros = np.ones(ids.size, np.int64), np.zeros(ids.size)
    return TokenStatsUpdate(2, ids, ones, ones, 2 * ones, zeros, 0 * ones, zeros, 0 * ones)


def random_groups(
    rng: np.random.Generator,
    prompt_ids: list[str],
    vocab: int = 14,
    teacher: bool = False,
) -> list[dict[str, Any]]:
    """Groups of 2-6 rollouts of 0-9 tokens from a small vocabulary (so tokens recur), some
    all-correct or all-wrong; an occasional large token id."""
    groups = []
    for pid in prompt_ids:
        n = int(rng.integers(2, 7))
        kind = rng.choice(["mixed", "mixed", "mixed", "all_correct", "all_wrong"])
        rollouts = []
        for _ in range(n):
            length = int(rng.integers(0, 10))
            tokens = rng.integers(0, vocab, size=length).tolist()
            if length and rng.random() < 0.2:
                tokens[0] = 151_935
            reward = {"all_correct": 1.0, "all_wrong": 0.0}.get(
                str(kind), float(rng.random() < 0.5)
            )
            rollout: dict[str, Any] = {"tokens": tokens, "reward": reward}
            if teacher:
                rollout["teacher_logprobs"] = {
                    "pos": (-rng.exponential(0.5, size=length)).tolist(),
                    "neg": (-rng.exponential(0.5, size=length)).tolist(),
                }
            rollouts.append(rollout)
        groups.append({"id": pid, "rollouts": rollouts})
    return groups


# ---- the oracle: KTAE with history, eagerly decayed, one token at a time ----------------------


@dataclass
class PromptCounts:
    """n_c, n_w, len_c, len_w and per token (a, b, occ_c, occ_w), as plain floats."""

    totals: np.ndarray
    tokens: dict[int, np.ndarray]


def group_counts(group: dict[str, Any], threshold: float, ignore: set[int]) -> PromptCounts:
    totals = np.zeros(4)
    tokens: dict[int, np.ndarray] = {}
    for rollout in group["rollouts"]:
        ok = rollout["reward"] > threshold
        toks = rollout["tokens"]
        totals += [ok, not ok, len(toks) * ok, len(toks) * (not ok)]
        for v in set(toks) - ignore:
            row = tokens.setdefault(v, np.zeros(4))
            row += [ok, not ok, toks.count(v) * ok, toks.count(v) * (not ok)]
    return PromptCounts(totals, tokens)


def merged_score(totals: np.ndarray, row: np.ndarray, params: dict[str, Any]) -> float:
    """kt(v) from merged (possibly fractional) counts: ESTIMATORS.md steps 1-7, with the
    counts rounded for the exact Fisher test only."""
    n_c, n_w, len_c, len_w = (float(x) for x in totals)
    a, b, occ_c, occ_w = (float(x) for x in row)
    if n_c <= 0 or n_w <= 0:
        return 0.0
    ra, rb, rn_c, rn_w = round(a), round(b), round(n_c), round(n_w)
    p = oracle.fisher_two_sided_p(ra, rb, rn_c - ra, rn_w - rb)
    fisher = oracle.fisher_significance(p)
    ig = oracle.information_gain_bits(a, b, n_c - a, n_w - b)
    direction = oracle.cohens_h(a / n_c, b / n_w)
    if params["tf"]:
        avg = (len_c + len_w) / 2.0
        s_c = oracle.tf_saturation(occ_c, len_c, avg, params["tf_k1"], params["tf_b"])
        s_w = oracle.tf_saturation(occ_w, len_w, avg, params["tf_k1"], params["tf_b"])
        direction = oracle.tf_direction(direction, s_c, s_w)
    z = oracle.ktae_combined(fisher, ig, direction, params["fisher_weight"], params["ig_weight"])
    return oracle.ktae_squash(z, params["scale"])


class HistoryOracle:
    """Per-prompt history kept the obvious way: every visit decays every stored token."""

    def __init__(self, params: dict[str, Any], ignore: set[int] | None = None) -> None:
        self.params = {**oracle.KTAE_DEFAULTS, **params}
        self.ignore = ignore or set()
        self.history: dict[str, PromptCounts] = {}

    def visit(
        self, groups: list[dict[str, Any]]
    ) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], np.ndarray]]:
        """Scores and merged token counts per (group index, token id) of one request; then the
        history is updated as H' = d (H + current)."""
        d = self.params["history_decay"]
        scores, merged = {}, {}
        for g, group in enumerate(groups):
            cur = group_counts(group, self.params["correct_threshold"], self.ignore)
            prev = self.history.get(group["id"], PromptCounts(np.zeros(4), {}))
            totals = cur.totals + prev.totals
            for v, row in cur.tokens.items():
                merged[(g, v)] = row + prev.tokens.get(v, np.zeros(4))
                scores[(g, v)] = merged_score(totals, merged[(g, v)], self.params)
            every = set(prev.tokens) | set(cur.tokens)
            self.history[group["id"]] = PromptCounts(
                d * totals,
                {
                    v: d * (prev.tokens.get(v, np.zeros(4)) + cur.tokens.get(v, np.zeros(4)))
                    for v in every
                },
            )
        return scores, merged

    def prior_totals(self, prompt: str) -> np.ndarray:
        return self.history[prompt].totals if prompt in self.history else np.zeros(4)
