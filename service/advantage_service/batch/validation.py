"""The checks a :class:`~advantage_service.batch.RolloutBatch` passes before any math reads it:
shapes, ranges, finite values, and the reward of a rollout that gave only reward components.
Each raises :class:`RequestError` naming the group, rollout and field of the first problem.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from advantage_contract.fields import (
    MAX_COMPONENT_NAME_LENGTH,
    MAX_REWARD_COMPONENTS,
    REWARD_COMPONENTS_FIELD,
)

from ..errors import LimitExceeded, RequestError

if TYPE_CHECKING:
    from . import RolloutBatch

# A log-probability may exceed 0 by float rounding in the client's softmax; more is a bug there.
LOGPROB_TOLERANCE = 1e-4
# Token ids travel as int32 (as tokenizers and varlen kernels store them).
INT32_LIMIT = 2**31
# An entropy may fall below 0, and a sum of squared probabilities above 1, by float rounding
# in the client; more is a bug there.
RANGE_TOLERANCE = 1e-4


def component_weights(params: Mapping[str, Any]) -> dict[str, float]:
    """The weights an estimator's parameters give the reward components (``weights``: name ->
    number); empty when they give none (every component then weighs 1)."""
    weights = params.get("weights")
    if not isinstance(weights, Mapping):
        return {}
    return {str(k): float(v) for k, v in weights.items()}


def summed_rewards(
    rewards: torch.Tensor,
    missing: torch.Tensor,
    components: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
) -> torch.Tensor:
    """``rewards`` (B,) with each ``missing`` rollout's reward replaced by the sum of its
    components' values times their weights (1 for a name ``weights`` lacks), None (NaN) values
    left out: TRL's ``sum_then_normalize``. Summed in float64, in name order."""
    total = torch.zeros(rewards.shape, dtype=torch.float64, device=rewards.device)
    for name in sorted(components):
        values = components[name].double() * weights.get(name, 1.0)
        total += torch.nan_to_num(values, nan=0.0)
    return torch.where(missing, total.float(), rewards)


def check_component_names(names: Any) -> None:
    """At most :data:`MAX_REWARD_COMPONENTS` names of at most
    :data:`MAX_COMPONENT_NAME_LENGTH` characters, each a non-empty string."""
    if len(names) > MAX_REWARD_COMPONENTS:
        raise LimitExceeded(
            f"the request has {len(names)} reward components; the limit is {MAX_REWARD_COMPONENTS}",
            field=REWARD_COMPONENTS_FIELD,
        )
    for name in names:
        if not isinstance(name, str) or not name:
            raise RequestError(
                "invalid_type",
                "a reward component name must be a non-empty string",
                field=REWARD_COMPONENTS_FIELD,
            )
        if len(name) > MAX_COMPONENT_NAME_LENGTH:
            raise LimitExceeded(
                f"a reward component name has {len(name)} characters; the limit is "
                f"{MAX_COMPONENT_NAME_LENGTH}",
                field=REWARD_COMPONENTS_FIELD,
            )


def validate(batch: RolloutBatch, vocab_size: int | None = None) -> None:
    """Check shapes and values; raise RequestError for the first problem found."""
    check_layout(batch)
    check_values(batch, vocab_size)


def check_layout(batch: RolloutBatch) -> None:
    """Offsets, group index, group ids and the components' names and shapes: what locating a
    rollout (for an error) and deriving rewards from components need."""
    n, b, g = batch.num_tokens, batch.num_rollouts, batch.num_groups
    if batch.offsets.numel() != b + 1:
        raise RequestError(
            "invalid_shape",
            f"offsets must have {b + 1} entries (rollouts + 1), got {batch.offsets.numel()}",
            field="offsets",
        )
    if batch.group_index.numel() != b:
        raise RequestError(
            "invalid_shape",
            f"group_index must have {b} entries, got {batch.group_index.numel()}",
            field="group_index",
        )
    if int(batch.offsets[0]) != 0 or int(batch.offsets[-1]) != n:
        raise RequestError(
            "invalid_shape",
            f"offsets must start at 0 and end at the token count {n}",
            field="offsets",
        )
    if b and bool((batch.lengths < 0).any()):
        raise RequestError("invalid_shape", "offsets must be non-decreasing", field="offsets")
    if b and (int(batch.group_index.min()) < 0 or int(batch.group_index.max()) >= g):
        raise RequestError(
            "invalid_value", f"group_index must lie in [0, {g})", field="group_index"
        )
    seen: dict[str, int] = {}
    for i, gid in enumerate(batch.group_ids):
        if gid in seen:
            raise RequestError(
                "duplicate_group",
                f"group id {gid!r} appears twice (groups {seen[gid]} and {i})",
                group_id=gid,
                field="id",
            )
        seen[gid] = i
    if g:
        empty = torch.nonzero(batch.group_sizes == 0)
        if empty.numel():
            gid = batch.group_ids[int(empty[0])]
            raise RequestError(
                "empty_group", f"group {gid!r} has no rollouts", group_id=gid, field="rollouts"
            )
    _check_components(batch)


def check_values(batch: RolloutBatch, vocab_size: int | None = None) -> None:
    """Rewards, token ids and per-token inputs in their ranges (after :func:`check_layout`)."""
    n = batch.num_tokens
    refuse_first_rollout(
        batch, ~torch.isfinite(batch.rewards), batch.rewards, "reward", "it must be finite"
    )
    if n:
        _check_tokens(batch, vocab_size)
    arrays = [("logprobs", batch.logprobs, LOGPROBS)] if batch.logprobs is not None else []
    arrays += [(f"teacher_logprobs.{k}", v, LOGPROBS) for k, v in batch.teacher_logprobs.items()]
    arrays += [(k, v, token_range(k)) for k, v in batch.token_inputs().items() if k != "logprobs"]
    for name, values, valid in arrays:
        _check_length(batch, name, values)
        # (the values are searched only when their extremes show a bad one)
        if values.numel() and not valid.holds(*extremes(values)):
            _refuse_first(batch, name, values, valid.outside(values), valid.why)


def _check_components(batch: RolloutBatch) -> None:
    """Reward components: bounded names, one value per rollout, each finite or NaN (None)."""
    components = batch.reward_components
    check_component_names(list(components))
    b = batch.num_rollouts
    for name, values in components.items():
        field = f"{REWARD_COMPONENTS_FIELD}.{name}"
        if values.numel() != b:
            raise RequestError(
                "length_mismatch",
                f"{field} has {values.numel()} values for {b} rollouts",
                field=field,
            )
        refuse_first_rollout(
            batch,
            torch.isinf(values),
            values,
            field,
            "it must be finite (or null where the rollout has none)",
        )


def _check_tokens(batch: RolloutBatch, vocab_size: int | None) -> None:
    # (one pass for both bounds; the positions are looked for only where one is broken)
    lowest, highest = (int(x) for x in torch.aminmax(batch.tokens))
    if lowest < 0:
        p = int(torch.nonzero(batch.tokens < 0)[0])
        raise RequestError(
            "token_out_of_range",
            f"token id {int(batch.tokens[p])} at token {batch.token_position(p)[1]} is negative",
            **batch.locate_token(p, "tokens"),
        )
    limit = min(vocab_size, INT32_LIMIT) if vocab_size is not None else INT32_LIMIT
    if highest >= limit:
        bad = torch.nonzero(batch.tokens >= limit)
        if bad.numel():
            p = int(bad[0])
            raise RequestError(
                "token_out_of_range",
                f"token id {int(batch.tokens[p])} at token {batch.token_position(p)[1]} is "
                f"not below {'vocab_size ' if limit == vocab_size else ''}{limit}",
                **batch.locate_token(p, "tokens"),
            )


def _check_length(batch: RolloutBatch, name: str, values: torch.Tensor) -> None:
    n = batch.num_tokens
    if values.numel() != n:
        raise RequestError(
            "length_mismatch",
            f"{name} has {values.numel()} values for {n} tokens",
            field=name,
        )


def refuse_first_rollout(
    batch: RolloutBatch, bad: torch.Tensor, values: torch.Tensor, field: str, why: str
) -> None:
    """Raise ``invalid_value`` for the first rollout where ``bad`` (bool (B,)), naming its
    value of ``field`` (``values``, (B,)) and ``why`` it is refused."""
    found = torch.nonzero(bad)
    if found.numel():
        i = int(found[0])
        raise RequestError(
            "invalid_value",
            f"{field} is {float(values[i])}; {why}",
            **batch.locate_rollout(i, field),
        )


def _refuse_first(
    batch: RolloutBatch, name: str, values: torch.Tensor, bad: torch.Tensor, why: str
) -> None:
    """Raise for the first token where ``bad`` (non-finite, else out of range: ``why``)."""
    found = torch.nonzero(bad)
    if found.numel():
        p = int(found[0])
        value = float(values[p])
        reason = "must be finite" if not np.isfinite(value) else why
        raise RequestError(
            "invalid_value",
            f"{name} value {value} at token {batch.token_position(p)[1]} {reason}",
            **batch.locate_token(p, name),
        )


def extremes(values: torch.Tensor) -> tuple[float, float]:
    """(least, greatest) of a non-empty float tensor, in one pass: NaN for both where any value
    is NaN (torch propagates it), so that one call tells that every value is finite and in a
    range (a tenth of the time :func:`torch.isfinite` and a comparison take on a CPU tensor);
    the values are searched for the bad one only where it says there is one."""
    low, high = torch.aminmax(values)
    return float(low), float(high)


def all_finite(values: torch.Tensor) -> bool:
    """Whether no value is NaN or infinite (by the :func:`extremes`; integers always are)."""
    if not values.is_floating_point() or not values.numel():
        return True
    return all(map(math.isfinite, extremes(values)))


@dataclass(frozen=True)
class TokenRange:
    """A per-token input's valid values: finite, above ``low`` (or at it, unless
    ``low_open``), at most ``high``, and one of ``only`` where given (a set, not an
    interval); ``why`` a value outside is refused."""

    why: str
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    only: tuple[float, ...] = ()

    def outside(self, values: torch.Tensor) -> torch.Tensor:
        """bool (N,): where a value is not finite or not in range."""
        bad = ~torch.isfinite(values) | (values > self.high)
        bad |= values <= self.low if self.low_open else values < self.low
        if self.only:
            allowed = torch.zeros_like(bad)
            for value in self.only:
                allowed |= values == value
            bad |= ~allowed
        return bad

    def holds(self, least: float, greatest: float) -> bool:
        """Whether every value between ``least`` and ``greatest`` (both included) is valid:
        each value of an interval, both ends of it; of a set, only when one value is all."""
        if not (math.isfinite(least) and math.isfinite(greatest)):
            return False
        above = least > self.low if self.low_open else least >= self.low
        if not (above and greatest <= self.high):
            return False
        return not self.only or (least == greatest and least in self.only)


# A log-probability (the student's or a teacher's).
LOGPROBS = TokenRange("is a log-probability above 0", high=LOGPROB_TOLERANCE)
# The other per-token inputs. The bounds that rounding can cross take RANGE_TOLERANCE;
# sum_pi_squared is not compared with pi_t^2 (a trainer's rounding may put it a little below).
TOKEN_RANGES = {
    "entropy": TokenRange("is a negative entropy", low=-RANGE_TOLERANCE),
    "sum_pi_squared": TokenRange(
        "must lie in (0, 1]", low=0.0, high=1 + RANGE_TOLERANCE, low_open=True
    ),
    "is_weights": TokenRange("is a negative importance weight", low=0.0),
    "returns": TokenRange("must be finite"),
    "planning_mask": TokenRange("must be 0 or 1", only=(0.0, 1.0)),
}


def token_range(name: str) -> TokenRange:
    """The valid values of the per-token input ``name``."""
    try:
        return TOKEN_RANGES[name]
    except KeyError:
        raise ValueError(f"no range for {name!r}") from None
