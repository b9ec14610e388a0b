"""Test helpers for the per-token methods: oracle-style groups (tests/oracle.py's
``random_token_groups``) as the flat batch plus flat per-token tensors, and flat tensors as the
right-padded (B, L) arrays that TRL and verl take."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from advantage_service.batch import RolloutBatch

PER_TOKEN = ("entropy", "logprobs", "sum_pi_squared", "is_weights")


def flat_batch(
    groups: list[list[dict[str, Any]]],
) -> tuple[RolloutBatch, dict[str, torch.Tensor]]:
    """The batch (tokens are 0: these methods never read them) and, per per-token field that
    every rollout has, its float32 (N,) tensor."""
    offsets, group_index, rewards = [0], [], []
    for g, rollouts in enumerate(groups):
        for rollout in rollouts:
            offsets.append(offsets[-1] + len(rollout["logprobs"]))
            group_index.append(g)
            rewards.append(rollout["reward"])
    batch = RolloutBatch.from_flat(
        np.zeros(offsets[-1], dtype=np.int32),
        np.array(offsets, dtype=np.int64),
        [f"g{g}" for g in range(len(groups))],
        np.array(group_index, dtype=np.int64),
        np.array(rewards, dtype=np.float32),
    )
    rollouts = [r for rs in groups for r in rs]
    fields = {
        name: torch.tensor([v for r in rollouts for v in r[name]], dtype=torch.float32)
        for name in PER_TOKEN
        if all(r.get(name) is not None for r in rollouts)
    }
    return batch, fields


def right_padded(
    batch: RolloutBatch, values: torch.Tensor, pad: float = 0.0, width: int | None = None
) -> torch.Tensor:
    """Flat per-token ``values`` (N,) as a right-padded (B, L) tensor (L: the longest rollout, at
    least 1, or ``width``), padding with ``pad``."""
    lengths = batch.lengths
    width = max(1, int(lengths.max()) if lengths.numel() else 1) if width is None else width
    out = torch.full((batch.num_rollouts, width), pad, dtype=values.dtype)
    column = torch.arange(width)
    out[column[None, :] < lengths[:, None]] = values
    return out


def response_mask(batch: RolloutBatch, width: int | None = None) -> torch.Tensor:
    """The float32 (B, L) mask of :func:`right_padded`'s layout: 1 on tokens, 0 on padding."""
    ones = torch.ones(batch.num_tokens, dtype=torch.float32)
    return right_padded(batch, ones, 0.0, width)


def unpadded(batch: RolloutBatch, padded: torch.Tensor) -> torch.Tensor:
    """The tokens' entries (N,) of a right-padded (B, L) tensor, in batch order."""
    mask = response_mask(batch, padded.shape[1]).bool()
    return padded[mask]
