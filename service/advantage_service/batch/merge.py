"""What a batch merging several requests (:meth:`RolloutBatch.concat
<advantage_service.batch.RolloutBatch.concat>`) holds where some of them lack an optional input:
a per-token input filled with its neutral value or dropped, reward components NaN (no value)
for the rollouts of a request without them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from advantage_contract.fields import TOKEN_FIELDS

if TYPE_CHECKING:
    from . import RolloutBatch

# The value that leaves the math unchanged where one merged request lacks an optional input and
# another has it (a weight of 1: x * 1 is x exactly). Inputs without one are dropped from a
# merged batch when some request lacks them (no term needs them then: every request of the
# merge passed the estimator's input check alone).
NEUTRAL_VALUES = {"is_weights": 1.0}


def concat_components(batches: Sequence[RolloutBatch]) -> dict[str, Any]:
    """The merged batch's reward components and derived-reward mask (see
    :meth:`RolloutBatch.concat`)."""
    names = sorted({name for b in batches for name in b.reward_components})
    if not names:
        return {}

    def part(b: RolloutBatch, name: str) -> torch.Tensor:
        values = b.reward_components.get(name)
        if values is not None:
            return values
        return torch.full((b.num_rollouts,), torch.nan, dtype=torch.float32, device=b.device)

    components = {name: torch.cat([part(b, name) for b in batches]) for name in names}
    derived = None
    if any(b.reward_derived is not None for b in batches):
        derived = torch.cat(
            [
                b.reward_derived
                if b.reward_derived is not None
                else torch.zeros(b.num_rollouts, dtype=torch.bool, device=b.device)
                for b in batches
            ]
        )
    return {"reward_components": components, "reward_derived": derived}


def concat_token_inputs(batches: Sequence[RolloutBatch]) -> dict[str, Any]:
    """The merged batch's optional per-token inputs (see :meth:`RolloutBatch.concat`)."""
    out = {}
    for name in TOKEN_FIELDS:
        parts = [getattr(b, name) for b in batches]
        if all(p is not None for p in parts):
            out[name] = torch.cat(parts)
        elif name == "returns" and any(p is not None for p in parts):
            # A request without returns has G_it = r_i: its rewards over its tokens.
            out[name] = torch.cat(
                [
                    p if p is not None else b.per_token(b.rewards.float())
                    for p, b in zip(parts, batches, strict=True)
                ]
            )
        elif name in NEUTRAL_VALUES and any(p is not None for p in parts):
            fill = NEUTRAL_VALUES[name]
            out[name] = torch.cat(
                [
                    p
                    if p is not None
                    else torch.full((b.num_tokens,), fill, dtype=torch.float32, device=b.device)
                    for p, b in zip(parts, batches, strict=True)
                ]
            )
    return out
