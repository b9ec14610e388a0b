"""Properties the math promises (ESTIMATORS.md), checked on generated batches with hypothesis."""

from __future__ import annotations

import numpy as np
import oracle
import pytest
import torch
from advantage_service import RolloutBatch, compute_batch
from hypothesis import given, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def batches(draw, *, min_group: int = 1, teachers: bool = False, vocab: int = 12):
    """A random flat batch: groups of 1-6 rollouts, 0-10 tokens each, small vocabulary."""
    n_groups = draw(st.integers(1, 4))
    sizes = [draw(st.integers(min_group, 6)) for _ in range(n_groups)]
    lengths = [draw(st.integers(0, 10)) for _ in range(sum(sizes))]
    binary = draw(st.booleans())
    reward = st.sampled_from([0.0, 1.0]) if binary else st.floats(-2, 2, width=32)
    rewards = [draw(reward) for _ in lengths]
    n = sum(lengths)
    tokens = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    extra = {}
    if teachers:
        lp = st.floats(-6, 0, width=32)
        extra["teacher_logprobs"] = {
            "pos": np.array(draw(st.lists(lp, min_size=n, max_size=n)), dtype=np.float32),
            "neg": np.array(draw(st.lists(lp, min_size=n, max_size=n)), dtype=np.float32),
        }
    return RolloutBatch.from_flat(
        tokens=np.array(tokens, dtype=np.int64),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        group_ids=[f"g{i}" for i in range(n_groups)],
        group_index=np.repeat(np.arange(n_groups), sizes),
        rewards=np.array(rewards, dtype=np.float32),
        **extra,
    )


def per_rollout_sums(batch: RolloutBatch, values: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(batch.num_rollouts, dtype=torch.float64)
    return out.index_add_(0, batch.rollout_of_token, values.double())


@SETTINGS
@given(batches(teachers=True), st.floats(0.0, 1.0), st.floats(0.0, 50.0), st.floats(0.0, 2.0))
def test_cscr_preserves_each_rollouts_credit_budget_and_sign(batch, strength, decay, onset):
    spec = {"outcome": "rloo", "cscr": {"strength": strength, "decay": decay, "onset": onset}}
    result = compute_batch(batch, spec, diagnostics=("cscr_weight",))
    scalar = result.scalars.double()
    budget = per_rollout_sums(batch, result.advantages)
    expected = scalar * batch.lengths.double()
    torch.testing.assert_close(budget, expected, rtol=1e-5, atol=1e-5)
    w = result.diagnostics["cscr_weight"]
    assert torch.all(w > 0) or (strength == 1.0 and torch.all(w >= 0))
    signs = torch.sign(result.advantages) * torch.sign(scalar[batch.rollout_of_token])
    nonzero = scalar[batch.rollout_of_token] != 0
    assert torch.all(signs[nonzero & (w > 0)] > 0)


@SETTINGS
@given(batches(teachers=True))
def test_cscr_with_strength_zero_is_the_outcome_baseline(batch):
    base = compute_batch(batch, "grpo")
    with_cscr = compute_batch(batch, {"outcome": "grpo", "cscr": {"strength": 0.0}})
    torch.testing.assert_close(with_cscr.advantages, base.advantages, rtol=0, atol=0)


@SETTINGS
@given(batches(teachers=True), st.floats(0.01, 1.0))
def test_cscr_tokens_below_onset_share_the_largest_weight(batch, strength):
    result = compute_batch(
        batch,
        {"outcome": "grpo", "cscr": {"strength": strength}},
        diagnostics=("cscr_weight", "sensitivity"),
    )
    w = result.diagnostics["cscr_weight"]
    s = result.diagnostics["sensitivity"]
    below = s <= 0.05
    rollout = batch.rollout_of_token
    for r in torch.unique(rollout[below]).tolist():
        mine = rollout == r
        quiet = w[mine & below]
        assert torch.allclose(quiet, quiet[0].expand_as(quiet), rtol=1e-6)
        assert torch.all(w[mine] <= quiet[0] * (1 + 1e-6))


@SETTINGS
@given(batches(min_group=2))
def test_grpo_scalars_sum_to_zero_in_every_group_of_two_or_more(batch):
    result = compute_batch(batch, "grpo")
    sums = torch.zeros(batch.num_groups, dtype=torch.float64).index_add_(
        0, batch.group_index, result.scalars.double()
    )
    assert torch.allclose(sums, torch.zeros_like(sums), atol=1e-4)


@SETTINGS
@given(batches(), st.floats(0.0, 3.0))
def test_ktae_scores_lie_within_scale_and_vanish_without_contrast(batch, scale):
    result = compute_batch(
        batch, {"outcome": "grpo", "ktae": {"scale": scale}}, diagnostics=("ktae_score",)
    )
    kt = result.diagnostics["ktae_score"]
    assert torch.all(kt.abs() <= scale + 1e-6)
    correct = batch.rewards > 0
    n_c = torch.zeros(batch.num_groups).index_add_(0, batch.group_index, correct.float())
    no_contrast = (n_c == 0) | (n_c == batch.group_sizes.float())
    silent = no_contrast[batch.group_index][batch.rollout_of_token]
    assert torch.all(kt[silent] == 0)


@SETTINGS
@given(batches(teachers=True), st.randoms(use_true_random=False))
def test_results_do_not_depend_on_the_order_of_groups(batch, rnd):
    spec = {"outcome": "rloo", "ktae": {}, "cscr": {}}
    before = compute_batch(batch, spec)
    perm = list(range(batch.num_groups))
    rnd.shuffle(perm)
    # Rebuild the batch with groups in the permuted order (rollouts move with their group).
    order = sorted(range(batch.num_rollouts), key=lambda i: perm.index(int(batch.group_index[i])))
    offsets = batch.offsets.numpy()
    pieces = [np.arange(offsets[i], offsets[i + 1]) for i in order]
    token_order = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    lengths = batch.lengths.numpy()[order]
    new_index = [perm.index(int(batch.group_index[i])) for i in order]
    shuffled = RolloutBatch.from_flat(
        tokens=batch.tokens.numpy()[token_order],
        offsets=np.concatenate([[0], np.cumsum(lengths)]),
        group_ids=[batch.group_ids[g] for g in perm],
        group_index=np.array(new_index, dtype=np.int64),
        rewards=batch.rewards.numpy()[order],
        teacher_logprobs={k: v.numpy()[token_order] for k, v in batch.teacher_logprobs.items()},
    )
    after = compute_batch(shuffled, spec)
    torch.testing.assert_close(after.advantages, before.advantages[token_order], rtol=0, atol=0)
    torch.testing.assert_close(after.scalars, before.scalars[order], rtol=0, atol=0)


@SETTINGS
@given(batches(teachers=True))
def test_interleaved_group_layout_gives_the_same_numbers(batch):
    """Rollouts of one group need not be adjacent in the flat batch."""
    spec = {"outcome": "opo", "ktae": {}, "cscr": {}}
    before = compute_batch(batch, spec)
    order = list(range(batch.num_rollouts))[::-1]  # reverse: groups interleave with themselves
    offsets = batch.offsets.numpy()
    pieces = [np.arange(offsets[i], offsets[i + 1]) for i in order]
    token_order = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    reversed_batch = RolloutBatch.from_flat(
        tokens=batch.tokens.numpy()[token_order],
        offsets=np.concatenate([[0], np.cumsum(batch.lengths.numpy()[order])]),
        group_ids=batch.group_ids,
        group_index=batch.group_index.numpy()[order],
        rewards=batch.rewards.numpy()[order],
        teacher_logprobs={k: v.numpy()[token_order] for k, v in batch.teacher_logprobs.items()},
    )
    after = compute_batch(reversed_batch, spec)
    # Reversal changes the rank of rollouts within groups, not the statistics.
    torch.testing.assert_close(
        after.advantages, before.advantages[token_order], rtol=1e-6, atol=1e-6
    )


def test_whitening_gives_zero_mean_unit_variance():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 30, size=12)
    batch = RolloutBatch.from_flat(
        tokens=rng.integers(0, 50, size=lengths.sum()),
        offsets=np.concatenate([[0], np.cumsum(lengths)]),
        group_ids=["a", "b", "c"],
        group_index=np.repeat(np.arange(3), 4),
        rewards=rng.random(12).astype(np.float32),
    )
    a = compute_batch(batch, "reinforce_pp_baseline").advantages.double()
    assert abs(a.mean().item()) < 1e-6
    assert abs(a.var().item() - 1) < 1e-5


def _fractional_tables(draw: st.DrawFn) -> tuple[float, float, float, float]:
    """(a, b, n_c, n_w) with 0 <= a <= n_c, 0 <= b <= n_w: whole or decayed (history) counts."""
    count = st.one_of(st.integers(0, 40).map(float), st.floats(1e-3, 40.0))
    n_c, n_w = draw(count), draw(count)
    # (shares of at least 1e-9: the oracle's plain float entropy cannot take a denormal count)
    share = st.sampled_from([0.0, 1.0]) | st.floats(1e-9, 1.0)
    return draw(share) * n_c, draw(share) * n_w, n_c, n_w


@SETTINGS
@given(st.lists(st.composite(_fractional_tables)(), min_size=1, max_size=40))
def test_information_gain_is_the_oracles_and_never_negative(tables):
    from advantage_service.estimators.ktae import information_gain

    a, b, n_c, n_w = (
        torch.tensor(column, dtype=torch.float64) for column in zip(*tables, strict=True)
    )
    got = information_gain(a, b, n_c, n_w)
    assert bool((got >= 0).all())
    for i, (ta, tb, tc, tw) in enumerate(tables):
        want = oracle.information_gain_bits(ta, tb, tc - ta, tw - tb) if tc + tw > 0 else 0.0
        assert float(got[i]) == pytest.approx(max(want, 0.0), abs=2e-12)


@st.composite
def _independent_tables(draw: st.DrawFn) -> tuple[float, float, float, float]:
    """(a, b, n_c, n_w) = k (q_c j, q_w j, q_c m, q_w m): the token in the same share j / m of
    the correct and of the wrong rollouts, counts decayed by k = 0.5^visits as history leaves
    them (history's default decay; powers of two keep counts and shares exact in float64)."""
    q_c, q_w, m = draw(st.integers(1, 8)), draw(st.integers(1, 8)), draw(st.integers(1, 8))
    j = draw(st.integers(0, m))
    k = 0.5 ** draw(st.integers(0, 5))
    return q_c * j * k, q_w * j * k, q_c * m * k, q_w * m * k


KEY, CONTROL = 1, 10  # fillers are 2..9


@st.composite
def independent_key_token_batches(draw: st.DrawFn) -> RolloutBatch:
    """Groups of |C| = q_c m correct and |W| = q_w m wrong rollouts (in any order) where token
    KEY is in q_c j correct and q_w j wrong ones (j >= 1: the same share j / m of both), any
    number of times, among filler tokens; token CONTROL is in every correct rollout and no
    wrong one (a perfect association, so the term has something to score)."""
    n_groups = draw(st.integers(1, 3))
    rollouts: list[list[int]] = []
    rewards: list[float] = []
    sizes = []
    for _ in range(n_groups):
        q_c, q_w, m = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
        j = draw(st.integers(1, m))
        members = [(True, i < q_c * j) for i in range(q_c * m)]
        members += [(False, i < q_w * j) for i in range(q_w * m)]
        for correct, has_key in draw(st.permutations(members)):
            tokens = [KEY] * draw(st.integers(1, 3)) if has_key else []
            tokens += draw(st.lists(st.integers(2, 9), max_size=6))
            tokens += [CONTROL] if correct else []
            rollouts.append(draw(st.permutations(tokens)))
            rewards.append(draw(st.sampled_from([0.5, 1.0] if correct else [0.0, -1.0])))
        sizes.append(len(members))
    lengths = [len(t) for t in rollouts]
    return RolloutBatch.from_flat(
        tokens=np.array([t for r in rollouts for t in r], dtype=np.int64),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        group_ids=[f"g{i}" for i in range(n_groups)],
        group_index=np.repeat(np.arange(n_groups), sizes),
        rewards=np.array(rewards, dtype=np.float32),
    )


@SETTINGS
@given(st.lists(_independent_tables(), min_size=1, max_size=40), independent_key_token_batches())
def test_an_independent_table_has_no_information_and_scores_zero(tables, batch):
    """A token as frequent among correct as among wrong rollouts (a / n_c = b / n_w): its
    information gain is exactly 0, for whole and for decayed (history) counts; and its KTAE
    score is exactly 0 on every occurrence, whatever its term frequencies (the table is the
    most likely one with its margins, so p = 1 and F = 0: no strength to scale them by)."""
    from advantage_service.estimators.ktae import information_gain

    a, b, n_c, n_w = (
        torch.tensor(column, dtype=torch.float64) for column in zip(*tables, strict=True)
    )
    assert torch.equal(a / n_c, b / n_w)  # independent by construction, every one of them
    assert bool((information_gain(a, b, n_c, n_w) == 0).all())

    score = compute_batch(batch, "ktae", diagnostics=("ktae_score",)).diagnostics["ktae_score"]
    key = batch.tokens == KEY
    assert bool(key.any())
    assert bool((score[key] == 0).all()), score[key]
    # The term ran and scored this batch: the perfectly associated token scores above 0.
    assert bool((score[batch.tokens == CONTROL] > 0).all())
