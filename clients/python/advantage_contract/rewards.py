"""A rollout's reward and its named reward components, checked as the flat builder
(:mod:`.flat`) reads them: numbers a float32 holds, component names bounded like teacher
conditions, the same names for every rollout (None where a rollout has no value). Needs numpy
only.
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Mapping
from typing import Any, TypeGuard

import numpy as np

from .arrays import to_number
from .errors import AdvantageError
from .fields import (
    EXACT_INTEGER_LIMIT,
    FLOAT32_MAX,
    MAX_COMPONENT_NAME_LENGTH,
    MAX_REWARD_COMPONENTS,
    REWARD_COMPONENTS_FIELD,
)


def _error(code: str, message: str, **where: Any) -> AdvantageError:
    return AdvantageError(code, message, **where)


def is_number(x: Any) -> TypeGuard[float]:
    """A real number (numpy scalars too), not a boolean."""
    if isinstance(x, bool | np.bool_):
        return False
    return isinstance(x, (int, float, numbers.Real))  # in this order: the ABC check is slow


def is_integer(x: Any) -> bool:
    if isinstance(x, bool | np.bool_):
        return False
    return isinstance(x, (int, numbers.Integral))


def check_reward(reward: Any, field: str, where: Mapping[str, Any]) -> None:
    """A reward (or a reward component's value): a number a float32 holds."""
    if not is_number(reward):
        raise _error(
            "invalid_type",
            f"{field} must be a number, got {reward!r:.80}",
            field=field,
            **where,
        )
    if isinstance(reward, int) and abs(reward) > sys.float_info.max:  # JSON allows it
        raise _error(
            "invalid_value",
            f"{field} is out of range; it must be finite",
            field=field,
            **where,
        )
    if is_integer(reward) and abs(int(reward)) > EXACT_INTEGER_LIMIT:
        raise _error(
            "invalid_value",
            f"{field} is an integer beyond 2**53 (9007199254740992), which a float64 cannot "
            "hold exactly; send it as a float",
            field=field,
            **where,
        )
    if abs(float(reward)) > FLOAT32_MAX and math.isfinite(float(reward)):
        # (rewards are float32 on the wire and in the batch: it would become inf)
        raise _error(
            "invalid_value",
            f"{field} {float(reward):g} is out of float32's range (|{field}| <= 3.4e38)",
            field=field,
            **where,
        )


def check_component_name(name: Any, **where: Any) -> str:
    """A reward component's name: a non-empty string of at most
    :data:`MAX_COMPONENT_NAME_LENGTH` characters."""
    if not isinstance(name, str) or not name:
        raise _error(
            "invalid_type",
            f"a reward component name must be a non-empty string, got {name!r:.80}",
            field=REWARD_COMPONENTS_FIELD,
            **where,
        )
    if len(name) > MAX_COMPONENT_NAME_LENGTH:
        raise _error(
            "limit_exceeded",
            f"a reward component name has {len(name)} characters; the limit is "
            f"{MAX_COMPONENT_NAME_LENGTH}",
            field=REWARD_COMPONENTS_FIELD,
            **where,
        )
    return name


def check_component_count(count: int, **where: Any) -> None:
    if count > MAX_REWARD_COMPONENTS:
        raise _error(
            "limit_exceeded",
            f"the request has more than {MAX_REWARD_COMPONENTS} reward components",
            field=REWARD_COMPONENTS_FIELD,
            **where,
        )


def rollout_components(value: Any, names: dict[str, None], r: int, where: Any) -> dict[str, Any]:
    """A rollout's ``reward_components`` checked (names, values: numbers or None); ``names``
    gathers the request's."""
    if not isinstance(value, Mapping):
        raise _error(
            "invalid_type",
            "reward_components must map component names to numbers (or null)",
            field=REWARD_COMPONENTS_FIELD,
            **where(r),
        )
    out = {}
    for name, given in value.items():
        check_component_name(name, **where(r))
        if name not in names:
            names[name] = None
            check_component_count(len(names), **where(r))
        x = to_number(given)  # (a 0-d array of any framework too)
        if x is not None and not (isinstance(x, float) and math.isnan(x)):
            check_reward(x, f"{REWARD_COMPONENTS_FIELD}.{name}", where(r))
        out[name] = x
    return out


def component_arrays(
    rows: list[dict[str, Any]], names: dict[str, None], count: int, where: Any
) -> dict[str, np.ndarray]:
    """Per component, its values over the rollouts (float64 (B,), NaN for None). Every rollout
    gives the same names, as every rollout gives the same teacher conditions: a value it lacks
    is given as null."""
    if not names:
        return {}
    # (the rollouts before the first that gave components gave none)
    rows = [{}] * (count - len(rows)) + rows
    out = {}
    for name in names:
        values = np.full(count, np.nan)
        for r, row in enumerate(rows):
            if name not in row:
                raise _error(
                    "missing_input",
                    f"reward component {name!r} is given for some rollouts but not this one; "
                    "give every component for every rollout (null where it has no value)",
                    field=f"{REWARD_COMPONENTS_FIELD}.{name}",
                    **where(r),
                )
            x = row[name]
            if x is not None:
                values[r] = float(x)
        out[name] = values
    return out
