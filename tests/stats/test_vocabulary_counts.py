"""The vocabulary statistics a request writes, counted from its batch (the path taken when no
term's tables hold every token: plain GRPO, KTAE with groups left out), against a count by
Python sets: per token id, the rollouts with reward > 0 and <= 0 containing it (once per
rollout however often it occurs) and its occurrences, for dense and sparse ids."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from advantage_service import RolloutBatch
from advantage_service.estimators import kernels
from advantage_service.serving.term_state import token_statistics


def slow_counts(batch: RolloutBatch) -> dict[int, tuple[int, int, int]]:
    """id -> (rollouts with reward > 0 containing it, the others containing it, occurrences)."""
    tokens, offsets = batch.tokens.tolist(), batch.offsets.tolist()
    rewards = batch.rewards.tolist()
    correct: Counter[int] = Counter()
    wrong: Counter[int] = Counter()
    occurrences: Counter[int] = Counter(tokens)
    for r, reward in enumerate(rewards):
        for v in set(tokens[offsets[r] : offsets[r + 1]]):
            (correct if reward > 0 else wrong)[v] += 1
    return {v: (correct[v], wrong[v], occurrences[v]) for v in occurrences}


@pytest.mark.parametrize("id_space", [50, 4000, 2**31 - 7], ids=["dense", "wide", "sparse"])
def test_counts_from_the_batch_equal_a_count_by_sets(id_space: int) -> None:
    rng = np.random.default_rng(id_space % 1009)
    rollouts = 40
    lengths = rng.integers(0, 60, size=rollouts)  # (empty rollouts among them)
    lengths[3] = 0
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    # ids drawn from 25 values spread over the id space: repeats within and across rollouts
    values = np.unique(rng.integers(0, id_space, size=25))
    batch = RolloutBatch.from_flat(
        tokens=rng.choice(values, size=int(offsets[-1])),
        offsets=offsets,
        group_ids=[f"g{g}" for g in range(8)],
        group_index=np.repeat(np.arange(8), 5),
        rewards=rng.choice([1.0, 0.0, -0.5, 0.25], size=rollouts).astype(np.float32),
    )
    update = token_statistics(batch, {})
    expected = slow_counts(batch)
    assert update.rollouts == rollouts
    assert update.tokens.tolist() == sorted(expected)
    got = zip(
        update.correct.tolist(), update.wrong.tolist(), update.occurrences.tolist(), strict=True
    )
    assert dict(zip(update.tokens.tolist(), got, strict=True)) == expected
    assert update.correct.sum() > 0 and update.wrong.sum() > 0
    # (a token repeated in a rollout counts that rollout once)
    assert (update.occurrences > update.correct + update.wrong).any()


def test_presence_refuses_an_id_outside_its_range() -> None:
    offsets = np.array([0, 2, 3], np.int64)
    correct = np.array([True, False])
    in_correct, in_wrong = kernels.presence(np.array([1, 1, 2]), offsets, correct, 3)
    assert in_correct.tolist() == [0, 1, 0] and in_wrong.tolist() == [0, 0, 1]
    for bad in (3, -1):
        with pytest.raises(IndexError):
            kernels.presence(np.array([1, 1, bad]), offsets, correct, 3)
