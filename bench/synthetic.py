"""The training-sized synthetic batch the benchmarks share.

32 groups x 16 rollouts, lengths uniform in [1, 4096], Zipf-distributed token ids over a
151,936-token vocabulary (Qwen2's), binary rewards with about half the groups mixed.
"""

from __future__ import annotations

import numpy as np
from advantage_service import RolloutBatch

VOCAB = 151_936


def zipf_tokens(rng: np.random.Generator, n: int, vocab: int = VOCAB, a: float = 1.1) -> np.ndarray:
    """Zipf ids (rank 1 = id 0) truncated to the vocabulary, shuffled so that frequent ids are
    spread over the id space as a real tokenizer's are."""
    ranks = rng.zipf(a, size=n)
    ranks = np.where(ranks > vocab, rng.integers(1, vocab + 1, size=n), ranks) - 1
    perm = np.random.default_rng(12345).permutation(vocab)
    return perm[ranks].astype(np.int32)


def training_batch(
    seed: int = 0,
    groups: int = 32,
    group_size: int = 16,
    max_len: int = 4096,
    teacher: bool = False,
) -> RolloutBatch:
    rng = np.random.default_rng(seed)
    b = groups * group_size
    lengths = rng.integers(1, max_len + 1, size=b)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    n = int(offsets[-1])
    accuracy = np.where(
        rng.random(groups) < 0.5,
        rng.choice([0.0, 1.0], size=groups),
        rng.uniform(0.1, 0.9, size=groups),
    )
    rewards = (rng.random(b) < np.repeat(accuracy, group_size)).astype(np.float32)
    logprobs = teacher_lp = None
    if teacher:
        logprobs = -rng.exponential(0.5, size=n).astype(np.float32)
        teacher_lp = {
            "pos": -rng.exponential(0.5, size=n).astype(np.float32),
            "neg": -rng.exponential(0.5, size=n).astype(np.float32),
        }
    return RolloutBatch.from_flat(
        tokens=zipf_tokens(rng, n),
        offsets=offsets,
        group_ids=[f"prompt-{g}" for g in range(groups)],
        group_index=np.repeat(np.arange(groups), group_size),
        rewards=rewards,
        logprobs=logprobs,
        teacher_logprobs=teacher_lp,
    )
