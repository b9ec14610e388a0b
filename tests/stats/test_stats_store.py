"""The stats store's behaviour, run on both backends (in-memory and a real redis-server).

History is checked against an independent slow computation: the oracle keeps each prompt's
counts eagerly decayed, merges them token by token and applies the ESTIMATORS.md formulas.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import oracle
import pytest
import torch
from advantage_service.stats import StatsStore
from stats_helpers import (
    HistoryOracle,
    assert_same_stored,
    assert_token_stats_are_the_sum,
    random_groups,
    read_history,
    serve,
    table_scores,
    update_of,
)

pytestmark = pytest.mark.anyio

NS = "train-a"


def ktae_body(groups: list[dict[str, Any]], **ktae: Any) -> dict[str, Any]:
    return {
        "namespace": NS,
        "estimator": {"outcome": "grpo", "ktae": {"history": "prompt", **ktae}},
        "return": ["ktae_score"],
        "groups": groups,
    }


def assert_scores_match(
    served_scores: dict[tuple[int, int], float],
    expected: dict[tuple[int, int], float],
    rtol: float,
    skip: frozenset[tuple[int, int]] | set[tuple[int, int]] = frozenset(),
    atol: float = 1e-12,
) -> None:
    assert set(served_scores) == set(expected)
    for key, want in expected.items():
        if key in skip:
            continue
        assert served_scores[key] == pytest.approx(want, rel=rtol, abs=atol), key


@pytest.mark.parametrize("decay", [0.5, 0.25])
async def test_history_changes_scores_exactly_as_the_merged_counts_say(
    store: StatsStore, decay: float
) -> None:
    rng = np.random.default_rng(7)
    prompts = [f"p{i}" for i in range(6)]
    expect = HistoryOracle({"history_decay": decay})
    # Visit 3 leaves out some prompts (they must not decay) and revisits the others, so rows
    # written at visit 1 but absent from visit 2 are read after two decays.
    for visit, visited in enumerate([prompts, prompts[:4], prompts[1:], prompts]):
        groups = random_groups(rng, visited)
        served = await serve(store, ktae_body(groups, history_decay=decay))
        # (the first visit reads successfully but finds nothing: every later one has history)
        assert served.history == ("applied" if visit else "empty")
        scores, _ = expect.visit(groups)
        assert_scores_match(table_scores(served.result), scores, rtol=1e-12)
        # The per-token bonus is the table's score spread to every occurrence.
        bonus = served.result.diagnostics["ktae_score"]
        tables = served.result.state["ktae"].tables
        spread = tables.spread(served.result.state["ktae"].score).float()
        assert torch.equal(bonus, spread)
        if visit:
            assert any(s != 0 for s in scores.values())


async def test_history_with_a_decay_that_is_not_a_power_of_two(store: StatsStore) -> None:
    rng = np.random.default_rng(11)
    prompts = [f"q{i}" for i in range(5)]
    expect = HistoryOracle({"history_decay": 0.3})
    for visited in [prompts, prompts[:3], prompts, prompts]:
        groups = random_groups(rng, visited)
        served = await serve(store, ktae_body(groups, history_decay=0.3))
        scores, merged = expect.visit(groups)
        # Stored values are float32 (blobs.py): 0.3^k times a count is rounded to ~6e-8
        # relative, which moves a score by about as much (scores are in [-1, 1]; one near 0,
        # a difference of near-equal proportions, moves by as much absolutely). A count within
        # that of .5 could round the other way in the Fisher table, so such tables (none
        # expected) are not compared.
        boundary = {
            k for k, row in merged.items() if np.any(np.abs(np.abs(row[:2] % 1) - 0.5) < 1e-6)
        }
        assert_scores_match(
            table_scores(served.result), scores, rtol=1e-6, skip=boundary, atol=1e-9
        )


async def test_first_visit_scores_equal_scores_without_history(store: StatsStore) -> None:
    rng = np.random.default_rng(3)
    groups = random_groups(rng, [f"f{i}" for i in range(8)])
    served = await serve(store, ktae_body(groups))
    plain = await serve(
        store,
        {
            "namespace": "other",
            "estimator": {"ktae": {}, "outcome": "grpo"},
            "return": ["ktae_score"],
            "groups": groups,
        },
    )
    assert served.prior is not None and float(served.prior.n_c.abs().sum()) == 0.0
    got, want = table_scores(served.result), table_scores(plain.result)
    # Without history only groups with contrast are tabulated; with history (even empty) every
    # group is, and those without contrast score 0.
    assert want.keys() <= got.keys() and want
    for key in got:
        assert got[key] == pytest.approx(want.get(key, 0.0), abs=1e-12)
    for key in got.keys() - want.keys():
        assert got[key] == 0.0
    bonus = served.result.diagnostics["ktae_score"]
    assert torch.equal(bonus, plain.result.diagnostics["ktae_score"])


async def test_history_prior_holds_the_decayed_counts(store: StatsStore) -> None:
    rng = np.random.default_rng(5)
    groups = random_groups(rng, ["a", "b", "c"])
    expect = HistoryOracle({"history_decay": 0.5})
    await serve(store, ktae_body(groups))
    expect.visit(groups)
    again = await serve(store, ktae_body(random_groups(rng, ["c", "a", "z"])))
    prior = again.prior
    assert prior is not None
    for g, prompt in enumerate(["c", "a", "z"]):
        want = expect.prior_totals(prompt)
        got = [float(t[g]) for t in (prior.n_c, prior.n_w, prior.len_c, prior.len_w)]
        assert got == pytest.approx(list(want))


async def test_ignored_tokens_never_enter_history(store: StatsStore) -> None:
    rng = np.random.default_rng(13)
    expect = HistoryOracle({}, ignore={0, 1})
    for _ in range(2):
        groups = random_groups(rng, ["i0", "i1", "i2"])
        body = {**ktae_body(groups), "ignore_token_ids": [0, 1]}
        served = await serve(store, body)
        scores, _ = expect.visit(groups)
        assert_scores_match(table_scores(served.result), scores, rtol=1e-12)
    prior = await read_history(store, NS, ["i0"])
    assert prior is not None and prior.stored[0] is not None and prior.stored[0].rows > 0
    assert not set(prior.stored[0].tokens.tolist()) & {0, 1}


async def test_zero_decay_forgets_everything(store: StatsStore) -> None:
    rng = np.random.default_rng(17)
    for _ in range(2):
        served = await serve(store, ktae_body(random_groups(rng, ["z0", "z1"]), history_decay=0.0))
        assert served.prior is not None
        assert float(served.prior.n_c.abs().sum()) == 0.0 and served.prior.rows == 0


async def test_history_is_per_namespace_and_prompt(store: StatsStore) -> None:
    rng = np.random.default_rng(19)
    await serve(store, ktae_body(random_groups(rng, ["shared"])))
    other_ns = await serve(store, {**ktae_body(random_groups(rng, ["shared"])), "namespace": "b"})
    other_prompt = await serve(store, ktae_body(random_groups(rng, ["unrelated"])))
    same = await serve(store, ktae_body(random_groups(rng, ["shared"])))
    for served in (other_ns, other_prompt):
        assert served.prior is not None and float(served.prior.n_c + served.prior.n_w) == 0.0
    assert same.prior is not None and float(same.prior.n_c + same.prior.n_w) > 0


async def test_duplicate_request_id_is_computed_again_but_not_counted(store: StatsStore) -> None:
    rng = np.random.default_rng(23)
    body = {**ktae_body(random_groups(rng, ["d0", "d1"])), "request_id": "req-1"}
    first = await serve(store, body)
    stats = await store.token_stats(NS, "occurrences", 1000)
    again = await serve(store, body)
    assert first.counted and not again.counted
    # Computed again, with the history the first request wrote, and answered normally.
    assert again.history == "applied" and again.result.advantages.shape == (
        first.req.batch.num_tokens,
    )
    assert await store.token_stats(NS, "occurrences", 1000) == stats
    third = await serve(store, {**body, "request_id": "req-2"})
    assert third.prior is not None and again.prior is not None
    assert_same_stored(third.prior, again.prior)
    after = await store.token_stats(NS, "occurrences", 1000)
    assert after is not None and stats is not None
    assert after["rollouts_counted"] == 2 * stats["rollouts_counted"]


async def test_request_ids_are_per_namespace_and_absent_ids_always_count(
    store: StatsStore,
) -> None:
    rng = np.random.default_rng(29)
    groups = random_groups(rng, ["x"])
    rollouts = len(groups[0]["rollouts"])
    body = {"namespace": "n1", "request_id": "same", "groups": groups}
    assert (await serve(store, body)).counted
    assert (await serve(store, {**body, "namespace": "n2"})).counted
    anonymous = {"namespace": "n1", "groups": groups}
    assert (await serve(store, anonymous)).counted
    assert (await serve(store, anonymous)).counted
    for ns, n in (("n1", 3), ("n2", 1)):
        stats = await store.token_stats(ns, "key", 5)
        assert stats is not None and stats["rollouts_counted"] == n * rollouts


async def test_token_statistics_match_a_slow_count(store: StatsStore) -> None:
    rng = np.random.default_rng(31)
    params = dict(oracle.KTAE_DEFAULTS)
    bodies: list[dict[str, Any]] = [
        {
            "namespace": "vocab",
            "estimator": {"outcome": "grpo", "ktae": {}, "cscr": {}},
            "groups": random_groups(rng, [f"g{i}" for i in range(4)], teacher=True),
        }
        for _ in range(3)
    ]
    correct: dict[int, int] = {}
    wrong: dict[int, int] = {}
    occurrences: dict[int, int] = {}
    key_scores: dict[int, list[float]] = {}
    sensitivities: dict[int, list[float]] = {}
    rollouts = 0
    for body in bodies:
        await serve(store, body)
        for group in body["groups"]:
            token_lists = [r["tokens"] for r in group["rollouts"]]
            ok = [r["reward"] > 0 for r in group["rollouts"]]
            rollouts += len(ok)
            for toks, good, rollout in zip(token_lists, ok, group["rollouts"], strict=True):
                for v in set(toks):
                    (correct if good else wrong)[v] = (correct if good else wrong).get(v, 0) + 1
                pos = np.asarray(rollout["teacher_logprobs"]["pos"], np.float32)
                neg = np.asarray(rollout["teacher_logprobs"]["neg"], np.float32)
                for t, v in enumerate(toks):
                    occurrences[v] = occurrences.get(v, 0) + 1
                    s = abs(float(pos[t]) - float(neg[t]))
                    sensitivities.setdefault(v, []).append(s)
            if any(ok) and not all(ok):
                for v in {v for toks in token_lists for v in toks}:
                    score = oracle.ktae_token_score(v, token_lists, ok, params)
                    key_scores.setdefault(v, []).append(score)
    stats = await store.token_stats("vocab", "occurrences", 10_000)
    assert stats is not None
    assert stats["namespace"] == "vocab" and stats["rollouts_counted"] == rollouts
    rows = {row["token_id"]: row for row in stats["tokens"]}
    assert set(rows) == set(occurrences)
    for v, row in rows.items():
        assert row["correct_rollouts"] == correct.get(v, 0)
        assert row["wrong_rollouts"] == wrong.get(v, 0)
        assert row["occurrences"] == occurrences[v]
        if v in key_scores:
            assert row["key_score"] == pytest.approx(np.mean(key_scores[v]), rel=1e-9, abs=1e-12)
        else:
            assert row["key_score"] is None
        assert row["mean_sensitivity"] == pytest.approx(np.mean(sensitivities[v]), rel=1e-9)
    counts = [row["occurrences"] for row in stats["tokens"]]
    assert counts == sorted(counts, reverse=True)


async def test_token_statistics_orders_and_limit(store: StatsStore) -> None:
    # Token 5 only in correct rollouts, 6 only in wrong ones, 7 everywhere (score 0), 8 in an
    # all-correct group only (no key score). Sensitivities: 5 -> 0.4, 6 -> 0.1, 7 -> 0.2.
    def rollout(tokens: list[int], reward: float, sens: dict[int, float]) -> dict[str, Any]:
        neg = [-0.5 - sens.get(v, 0.0) for v in tokens]
        return {
            "tokens": tokens,
            "reward": reward,
            "teacher_logprobs": {"pos": [-0.5] * len(tokens), "neg": neg},
        }

    sens = {5: 0.4, 6: 0.1, 7: 0.2, 8: 0.0}
    body = {
        "namespace": "orders",
        "estimator": {"outcome": "grpo", "ktae": {}, "cscr": {}},
        "groups": [
            {
                "id": "m",
                "rollouts": [
                    rollout([5, 7, 7, 7], 1.0, sens),
                    rollout([5, 7, 7], 1.0, sens),
                    rollout([6, 7, 7], 0.0, sens),
                ],
            },
            {"id": "c", "rollouts": [rollout([8], 1.0, sens), rollout([8], 1.0, sens)]},
        ],
    }
    await serve(store, body)

    async def ids(order: str, limit: int = 10) -> list[int]:
        stats = await store.token_stats("orders", order, limit)
        assert stats is not None
        return [row["token_id"] for row in stats["tokens"]]

    stats = await store.token_stats("orders", "key", 10)
    assert stats is not None
    by_id = {row["token_id"]: row for row in stats["tokens"]}
    assert by_id[5]["key_score"] > 0 > by_id[6]["key_score"]
    assert by_id[7]["key_score"] == 0.0 and by_id[8]["key_score"] is None
    magnitudes = [abs(by_id[v]["key_score"]) for v in (await ids("key"))[:3]]
    assert magnitudes == sorted(magnitudes, reverse=True)
    assert (await ids("key"))[2:] == [7, 8]
    assert await ids("sensitivity") == [5, 7, 6, 8]
    assert await ids("occurrences") == [7, 5, 8, 6]
    assert await ids("occurrences", 2) == [7, 5]
    assert await ids("occurrences", 0) == []
    with pytest.raises(ValueError):
        await store.token_stats("orders", "alphabetical", 10)


async def test_unknown_namespace_has_empty_statistics(store: StatsStore) -> None:
    assert await store.token_stats("never-seen", "key", 10) == {
        "namespace": "never-seen",
        "rollouts_counted": 0,
        "tokens": [],
    }


async def test_unavailable_history_writes_no_history(store: StatsStore) -> None:
    """A request computed without history (the store was down for its read) must not
    overwrite stored history with its own counts; its token statistics still count."""
    rng = np.random.default_rng(37)
    await serve(store, ktae_body(random_groups(rng, ["h"])))
    before = await read_history(store, NS, ["h"])
    update = await update_of(store, ktae_body(random_groups(rng, ["h"])), read=False)
    assert not update.records
    assert await store.record(NS, None, update)
    after = await read_history(store, NS, ["h"])
    assert before is not None and after is not None and before.rows > 0
    assert_same_stored(before, after)


async def test_empty_rollouts_count_in_history_totals(store: StatsStore) -> None:
    groups = [
        {"id": "e", "rollouts": [{"tokens": [], "reward": 1.0}, {"tokens": [], "reward": 0.0}]}
    ]
    first = await serve(store, ktae_body(groups))
    second = await serve(store, ktae_body(groups))
    assert first.counted and second.prior is not None
    assert [float(second.prior.n_c[0]), float(second.prior.n_w[0])] == [0.5, 0.5]


async def test_pruning_keeps_a_prompts_history_bounded_over_many_visits(store: StatsStore) -> None:
    """Each visit brings 5 tokens never seen before, once each: a row worth a + occ = 2, which
    the write decays to 1 and every later visit halves. Below 1e-3 it is dropped, so after any
    visit the prompt holds exactly the tokens of its last 10 visits."""

    def visit_body(k: int) -> dict[str, Any]:
        fresh = [1000 * k + i for i in range(5)]
        rollouts = [{"tokens": fresh, "reward": 1.0}, {"tokens": [7], "reward": 0.0}]
        return ktae_body([{"id": "long-lived", "rollouts": rollouts}])

    for k in range(1, 41):
        await serve(store, visit_body(k))
        prior = await read_history(store, NS, ["long-lived"])
        assert prior is not None and prior.stored is not None and prior.stored[0] is not None
        stored = prior.stored[0]
        kept = sorted({t // 1000 for t in stored.tokens.tolist() if t != 7})
        assert kept == list(range(max(1, k - 9), k + 1)), k
        assert stored.rows == 5 * len(kept) + 1
        # Token 7 is in every visit: b = 0.5 (b + 1) each time, 1 - 2^-k after visit k.
        b_7 = float(stored.values[stored.tokens == 7, 1][0])
        assert b_7 == pytest.approx(1 - 0.5**k, rel=1e-7)


async def test_token_statistics_equal_the_sum_of_every_update_across_compactions(
    store_factory: Any, backend: str
) -> None:
    """Many requests; on Redis a compaction every 3 pending deltas, and reads in between."""
    store = store_factory(**({"compact_after": 3} if backend.startswith("redis") else {}))
    rng = np.random.default_rng(41)
    updates = []
    for i in range(20):
        estimator: Any = [
            {"outcome": "grpo", "ktae": {}, "cscr": {}},
            {"outcome": "grpo", "ktae": {"history": "prompt"}},
            "grpo",
        ][i % 3]
        body = {
            "namespace": "sums",
            "estimator": estimator,
            "groups": random_groups(rng, [f"s{j}" for j in range(3)], vocab=40, teacher=True),
        }
        served = await serve(store, body)
        assert served.counted
        updates.append(served.update.tokens)
        if i % 7 == 3:
            assert await store.token_stats("sums", "key", 5) is not None
    assert_token_stats_are_the_sum(await store.token_stats("sums", "occurrences", 10**6), updates)


async def test_the_vocabulary_statistics_are_ranked_off_the_event_loop(
    store: StatsStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranking a vocabulary's worth of ids for ``GET /v1/stats/tokens`` takes 12-18 ms: on the
    event loop it held back every other client's request at each read."""
    import threading

    from advantage_service.stats import base

    threads: list[int] = []
    rank = base.token_stats_response

    def recording(*args: Any) -> dict[str, Any]:
        threads.append(threading.get_ident())
        return rank(*args)

    monkeypatch.setattr(base, "token_stats_response", recording)
    rng = np.random.default_rng(37)
    assert (await serve(store, ktae_body(random_groups(rng, ["p"])))).counted
    stats = await store.token_stats(NS, "occurrences", 5)
    assert stats is not None and len(stats["tokens"]) == 5
    assert threads and threading.get_ident() not in threads
