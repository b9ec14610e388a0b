"""The batched two-sided Fisher exact test against scipy on every table up to margins of 24."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from advantage_service.estimators.fisher import (
    fisher_two_sided,
    fisher_two_sided_grouped,
    pvalue_grid,
)
from scipy.stats import fisher_exact

MAX_MARGIN = 24


@pytest.fixture(scope="module")
def all_tables() -> np.ndarray:
    return np.array(
        [
            (n1, n2, a, b)
            for n1 in range(MAX_MARGIN + 1)
            for n2 in range(MAX_MARGIN + 1)
            for a in range(n1 + 1)
            for b in range(n2 + 1)
        ]
    )


def canonical_tables(tables: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct tables up to the 2x2 table's symmetries (swapping its rows, its columns,
    transposing it: Fisher's two-sided p is the same for all eight), as cells [[a, b], [c, d]],
    and for each of ``tables`` (rows n1, n2, a, b) the index of its canonical one."""
    n1, n2, a, b = tables.T
    cells = np.stack([a, b, n1 - a, n2 - b])  # [[a, b], [c, d]]
    orders = [(0, 1, 2, 3), (1, 0, 3, 2), (2, 3, 0, 1), (3, 2, 1, 0),
              (0, 2, 1, 3), (2, 0, 3, 1), (1, 3, 0, 2), (3, 1, 2, 0)]  # fmt: skip
    base = MAX_MARGIN + 1
    powers = base ** np.arange(3, -1, -1)  # (a table's cells as the digits of one number)
    codes = np.stack([powers @ cells[list(order)] for order in orders]).min(axis=0)
    unique, index = np.unique(codes, return_inverse=True)
    return unique[:, None] // powers % base, index


@pytest.mark.slow
def test_fisher_matches_scipy_on_every_table_with_margins_up_to_24(all_tables):
    t = torch.from_numpy(all_tables)
    fast = fisher_two_sided(t[:, 0], t[:, 1], t[:, 2], t[:, 3]).numpy()
    # scipy once per table up to its symmetries (5.5x fewer calls, of ~0.7 ms each) ...
    canonical, index = canonical_tables(all_tables)
    assert len(canonical) < len(all_tables) / 5
    expected = np.array([fisher_exact([[a, b], [c, d]])[1] for a, b, c, d in canonical])[index]
    # ... which give scipy's p of the table itself (checked on a sample of them).
    rng = np.random.default_rng(0)
    for n1, n2, a, b in all_tables[rng.choice(len(all_tables), 300, replace=False)]:
        want = fisher_exact([[a, b], [n1 - a, n2 - b]])[1]
        p = expected[np.flatnonzero((all_tables == (n1, n2, a, b)).all(axis=1))[0]]
        assert p == pytest.approx(want, rel=1e-12, abs=1e-15), (n1, n2, a, b)
    worst = int(np.argmax(np.abs(fast - expected)))
    np.testing.assert_allclose(
        fast,
        expected,
        rtol=1e-9,
        atol=1e-12,
        err_msg=f"worst table (n1, n2, a, b) = {tuple(all_tables[worst])}",
    )


def test_fisher_p_is_one_for_tables_at_the_mode():
    # Equal presence rates: the observed table is the most likely one.
    n1 = torch.tensor([4, 8, 6])
    n2 = torch.tensor([4, 8, 3])
    a = torch.tensor([2, 4, 4])
    b = torch.tensor([2, 4, 2])
    p = fisher_two_sided(n1, n2, a, b)
    assert torch.all(p > 1 - 1e-12)


def test_fisher_extreme_table_has_the_hypergeometric_probability_doubled():
    # [[4, 0], [0, 4]]: the two extreme tables are equally likely, 1 / C(8, 4) each.
    p = fisher_two_sided(torch.tensor([4]), torch.tensor([4]), torch.tensor([4]), torch.tensor([0]))
    assert p.item() == pytest.approx(2 / 70, rel=1e-12)


def test_pvalue_grid_marks_impossible_tables_with_one():
    grid = pvalue_grid(torch.tensor([2]), torch.tensor([1]))
    # k = a + b = 3 with a = 0 would need b = 3 > n2 = 1.
    assert grid[0, 3, 0].item() == 1.0
    assert grid.shape == (1, 4, 3)


def test_grouped_fisher_equals_per_table_fisher():
    gen = torch.Generator().manual_seed(0)
    n1 = torch.randint(0, 20, (7,), generator=gen)
    n2 = torch.randint(0, 20, (7,), generator=gen)
    group = torch.randint(0, 7, (500,), generator=gen)
    a = (torch.rand(500, generator=gen) * (n1[group] + 1)).long()
    b = (torch.rand(500, generator=gen) * (n2[group] + 1)).long()
    grouped = fisher_two_sided_grouped(n1, n2, group, a, b)
    per_table = fisher_two_sided(n1[group], n2[group], a, b)
    torch.testing.assert_close(grouped, per_table, rtol=0, atol=0)
