"""The local stand-in refuses grpo's scaling parameters it does not compute (a request-wide
mean or std, leave-one-out, ...) instead of answering them as the group-scoped default."""

from __future__ import annotations

import pytest
from advantage_client.integrations import fallback
from advantage_service.estimators.baselines import GRPO_DEFAULTS


def resolved(**params: object) -> dict[str, object]:
    return {"outcome": {"name": "grpo", **GRPO_DEFAULTS, **params}, "whiten": False, "clip": None}


def test_the_defaults_and_zero_signal_have_a_stand_in() -> None:
    assert fallback.unsupported(resolved()) is None
    assert fallback.unsupported(resolved(zero_signal="zero")) is None


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("mean_scope", "request"),
        ("mean_scope", "none"),
        ("std_scope", "request"),
        ("std_scope", "none"),
        ("leave_one_out", True),
        ("std_unbiased", False),
        ("std_center", "baseline"),
    ],
)
def test_other_scaling_values_need_the_service(param: str, value: object) -> None:
    why = fallback.unsupported(resolved(**{param: value}))
    assert why is not None and param in why


def test_the_stand_in_knows_every_grpo_parameter_the_service_has() -> None:
    # A parameter added to grpo without a decision here would be answered with the default.
    known = set(fallback.GRPO_LOCAL_VALUES) | {"norm_by_std", "epsilon"}
    assert set(GRPO_DEFAULTS) <= known
