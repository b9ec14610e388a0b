"""``HistoryPrior.lookup``: the stored rows of (group, token id) pairs, checked against a lookup
in plain dictionaries, on both of its paths (dense token ids and sparse ones)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from advantage_service.estimators.ktae_history import (
    DENSE_LOOKUP_LIMIT,
    TOKEN_DTYPE,
    VALUE_DTYPE,
    HistoryPrior,
    PromptHistory,
)


def random_history(rng: np.random.Generator, id_space: int, rows: int) -> PromptHistory:
    tokens = np.unique(rng.integers(0, id_space, size=rows)).astype(TOKEN_DTYPE)
    values = (rng.integers(0, 9, size=(tokens.size, 4)) * 0.25).astype(VALUE_DTYPE)
    totals = values.max(axis=0).astype(np.float64) + rng.integers(0, 3, size=4)
    return PromptHistory(totals, tokens, values)


def slow_lookup(
    stored: list[PromptHistory | None], group: np.ndarray, token: np.ndarray
) -> np.ndarray:
    rows = {
        (g, int(t)): np.minimum(h.values[i].astype(np.float64), h.totals)
        for g, h in enumerate(stored)
        if h is not None
        for i, t in enumerate(h.tokens)
    }
    return np.array(
        [rows.get((int(g), int(t)), np.zeros(4)) for g, t in zip(group, token, strict=True)]
    ).reshape(-1, 4)


@pytest.mark.parametrize("id_space", [60, 5_000, DENSE_LOOKUP_LIMIT + 10, 2**31 - 1])
@pytest.mark.parametrize("sorted_pairs", [True, False])
@pytest.mark.parametrize("path", ["scratch", "search"])
def test_lookup_finds_exactly_the_stored_rows(id_space: int, sorted_pairs: bool, path: str) -> None:
    rng = np.random.default_rng(id_space % 1000 + sorted_pairs)
    groups = 7
    stored: list[PromptHistory | None] = [random_history(rng, id_space, 40) for _ in range(groups)]
    stored[2] = None  # a prompt never seen
    stored[4] = PromptHistory(np.ones(4), np.zeros(0, TOKEN_DTYPE), np.zeros((0, 4), VALUE_DTYPE))
    pairs = []
    for g, history in enumerate(stored):
        if g == 5:
            continue  # a group without pairs between groups with some
        known = history.tokens[::2].astype(np.int64) if history is not None else []
        fresh = rng.integers(0, id_space, size=15)
        for t in np.unique(np.concatenate([known, fresh])):
            pairs.append((g, int(t)))
    group = np.array([g for g, _ in pairs], np.int64)
    token = np.array([t for _, t in pairs], np.int64)
    if not sorted_pairs:
        perm = rng.permutation(group.size)
        group, token = group[perm], token[perm]
    prior = HistoryPrior.from_stored(stored)
    # (search: the accelerators' path, run on the CPU here; test_cuda runs it there)
    got = prior.lookup(torch.from_numpy(group), torch.from_numpy(token), method=path)
    assert got.dtype == torch.float64 and got.shape == (group.size, 4)
    want = slow_lookup(stored, group, token)
    np.testing.assert_array_equal(got.numpy(), want)
    assert (got.numpy() != 0).any(axis=1).sum() > 10, "some pairs must have found rows"
    # Where each pair's row is in its prompt's history: what the write merges into.
    values, rows = prior.lookup_rows(torch.from_numpy(group), torch.from_numpy(token), path)
    assert torch.equal(values, got) and rows.dtype == torch.int64
    want_rows = [
        int(np.searchsorted(stored[g].tokens, t))
        if stored[g] is not None and t in set(stored[g].tokens.tolist())
        else -1
        for g, t in zip(group.tolist(), token.tolist(), strict=True)
    ]
    assert rows.tolist() == want_rows and max(want_rows) > 0


def test_lookup_clamps_float32_rounding_to_the_totals() -> None:
    # 0.1 rounded to float32 is above the float64 total 0.1.
    history = PromptHistory(
        np.array([0.1, 0.9, 5.0, 5.0]),
        np.array([3], TOKEN_DTYPE),
        np.array([[0.1, 0.2, 1.0, 1.0]], VALUE_DTYPE),
    )
    assert float(np.float32(0.1)) > 0.1
    got = HistoryPrior.from_stored([history]).lookup(torch.tensor([0]), torch.tensor([3]))
    assert float(got[0, 0]) == 0.1 and float(got[0, 1]) == float(np.float32(0.2))


def test_lookup_of_no_pairs_and_of_no_history() -> None:
    empty = torch.zeros(0, dtype=torch.int64)
    rng = np.random.default_rng(0)
    prior = HistoryPrior.from_stored([random_history(rng, 50, 10)])
    assert prior.lookup(empty, empty).shape == (0, 4)
    none = HistoryPrior.from_stored([None, None])
    got = none.lookup(torch.tensor([0, 1]), torch.tensor([5, 6]))
    assert torch.equal(got, torch.zeros(2, 4, dtype=torch.float64))
    assert none.rows == 0 and float(none.n_c.sum()) == 0.0


@pytest.mark.parametrize("largest", [50, 2**31 - 1, 2**40])
def test_distinct_keys_are_torch_unique(largest: int) -> None:
    from advantage_service.serving.term_state import _distinct

    rng = np.random.default_rng(largest % 97)
    keys = torch.from_numpy(rng.integers(0, largest, size=5000, dtype=np.int64))
    keys[:100] = keys[100:200]  # duplicates for sure
    got = _distinct(keys)
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.unique(keys))
    assert _distinct(torch.zeros(0, dtype=torch.int64)).numel() == 0


@pytest.mark.parametrize("decay", [0.5, 0.3, 0.0])
def test_a_visit_merged_through_its_lookups_rows_leaves_the_searched_record(decay: float) -> None:
    """The write merges a visit's counts into the rows its lookup found instead of searching
    them again: the record is the same, byte for byte."""
    from advantage_service.estimators.ktae_history import encode_history, merge_history

    rng = np.random.default_rng(int(decay * 10))
    stored = random_history(rng, 300, 120)
    stored.values[::7] = 1e-4  # rows the decay prunes
    tokens = np.unique(rng.integers(0, 300, size=80)).astype(np.int64)
    values = rng.integers(0, 5, size=(tokens.size, 4)).astype(np.float64)
    prior = HistoryPrior.from_stored([stored])
    _, rows = prior.lookup_rows(
        torch.zeros(tokens.size, dtype=torch.int64), torch.from_numpy(tokens)
    )
    assert (rows >= 0).any() and (rows < 0).any()
    totals = np.array([3.0, 4.0, 50.0, 60.0])
    given = merge_history(stored, totals, tokens, values, decay, rows.numpy())
    searched = merge_history(stored, totals, tokens, values, decay)
    assert encode_history(given) == encode_history(searched)
    assert given.rows > 0 or decay == 0.0
