"""TRL's settings that decide how rewards become advantages (``scale_rewards``,
``multi_objective_aggregation``, ``reward_weights``), honoured by the estimator the TRL
integration sends or refused when the trainer is built (:mod:`.trl`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from advantage_contract.fields import MAX_COMPONENT_NAME_LENGTH, MAX_REWARD_COMPONENTS

AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def config_value(args: tuple[Any, ...], kwargs: Mapping[str, Any], name: str, default: Any) -> Any:
    """A ``GRPOConfig`` setting of the trainer's arguments (``args=`` or the third positional)."""
    config = kwargs.get("args", args[2] if len(args) > 2 else None)
    return getattr(config, name, default)


def _given_outcome(estimator: Any) -> Mapping[str, Any]:
    """The outcome object the user's estimator sets itself ({} for a preset name)."""
    given = estimator.get("outcome") if isinstance(estimator, Mapping) else None
    return given if isinstance(given, Mapping) else {}


def with_trl_settings(
    estimator: Any, resolved: dict[str, Any], scale: Any, aggregation: str
) -> tuple[Any, dict[str, Any]]:
    """TRL's ``scale_rewards`` and ``multi_objective_aggregation`` honoured or refused: (the
    estimator to send, its resolved form).

    ``"group"`` (TRL's default) leaves the estimator as it is; ``"none"`` turns off the
    outcome's division by the std; ``"batch"`` makes ``grpo`` divide by the std of the whole
    batch (``std_scope: "request"``: the call holds the whole batch TRL scales over, every
    rank's rows). ``normalize_then_sum`` is the ``gdpo`` outcome with TRL's normalisation
    (``normalization: "trl"``; TRL ignores ``scale_rewards`` there, and so does this), and
    ``gdpo`` needs it. An estimator whose own setting contradicts TRL's is refused."""
    scale = {True: "group", False: "none"}.get(scale, scale)
    if aggregation not in AGGREGATIONS:
        raise ValueError(
            f"multi_objective_aggregation must be one of {list(AGGREGATIONS)}, got {aggregation!r}"
        )
    if scale not in ("group", "none", "batch"):
        raise ValueError(f"scale_rewards must be 'group', 'none' or 'batch', got {scale!r}")
    outcome = resolved.get("outcome") or {}
    given = _given_outcome(estimator)
    if aggregation == "normalize_then_sum" or outcome.get("name") == "gdpo":
        return _normalize_then_sum(resolved, outcome, given, aggregation)
    if scale == "batch":
        if outcome.get("name") != "grpo":
            raise ValueError(
                "scale_rewards='batch' divides by the std of the whole batch, which only the "
                f"grpo outcome does (std_scope 'request'), not {outcome.get('name')!r}: use "
                "an estimator with outcome grpo, or scale_rewards='group' or 'none'"
            )
        if given.get("norm_by_std") is False or given.get("std_scope") == "group":
            raise ValueError(
                "scale_rewards='batch' but the estimator's outcome sets "
                f"norm_by_std={given.get('norm_by_std')!r}, "
                f"std_scope={given.get('std_scope')!r}: choose one (scale_rewards='group' "
                "or 'none', or drop them)"
            )
        changed = {
            **resolved,
            "outcome": {**outcome, "norm_by_std": True, "std_scope": "request"},
        }
        return changed, changed
    if given.get("std_scope") == "request" and given.get("norm_by_std") is not False:
        raise ValueError(
            f"scale_rewards={scale!r} but the estimator's outcome sets std_scope='request' "
            "(the batch's std): choose one (scale_rewards='batch', or drop std_scope)"
        )
    if scale == "group" or "norm_by_std" not in outcome or not outcome["norm_by_std"]:
        return estimator, resolved
    if given.get("norm_by_std") is True:
        raise ValueError(
            "scale_rewards='none' but the estimator's outcome sets norm_by_std=True: "
            "choose one (scale_rewards='group', or drop norm_by_std)"
        )
    changed = {**resolved, "outcome": {**outcome, "norm_by_std": False}}
    return changed, changed


def _normalize_then_sum(
    resolved: dict[str, Any],
    outcome: Mapping[str, Any],
    given: Mapping[str, Any],
    aggregation: str,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``normalize_then_sum`` as the ``gdpo`` outcome with TRL's normalisation."""
    if outcome.get("name") != "gdpo":
        raise ValueError(
            "multi_objective_aggregation='normalize_then_sum' normalises each reward function "
            "within its group before the weighted sum (GDPO), which only the gdpo outcome does, "
            f"not {outcome.get('name')!r}: use advantage_estimator='gdpo' (or an estimator "
            "with outcome gdpo and its terms)"
        )
    if aggregation != "normalize_then_sum":
        raise ValueError(
            "the gdpo outcome normalises each reward function before the sum: set "
            "multi_objective_aggregation='normalize_then_sum' (TRL's GDPO), or use another "
            "outcome with 'sum_then_normalize'"
        )
    if given.get("normalization", "trl") != "trl":
        raise ValueError(
            f"multi_objective_aggregation='normalize_then_sum' is TRL's normalisation, but the "
            f"estimator's outcome sets normalization={given['normalization']!r}: drop it"
        )
    changed = {**resolved, "outcome": {**outcome, "normalization": "trl"}}
    return changed, changed


def reward_components_weights(
    names: Sequence[str], weights: Sequence[float], given: Any
) -> dict[str, float]:
    """The gdpo outcome's ``weights``: TRL's ``reward_weights`` by reward function name
    (``given``: the estimator as the user gave it).
    Refuses names the service cannot take apart (the same name twice, too many, too long)
    and weights of the estimator's own that contradict TRL's."""
    names = list(names)
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(
            f"normalize_then_sum sends each reward function's rewards under its name, and "
            f"{twice} names several: give the functions distinct __name__s"
        )
    if len(names) > MAX_REWARD_COMPONENTS:
        raise ValueError(
            f"{len(names)} reward functions; the service takes at most {MAX_REWARD_COMPONENTS}"
        )
    long = [n for n in names if len(n) > MAX_COMPONENT_NAME_LENGTH]
    if long:
        raise ValueError(
            f"reward function name {long[0]!r} is longer than {MAX_COMPONENT_NAME_LENGTH} "
            "characters, the most a reward component's name may have"
        )
    trl = {name: float(w) for name, w in zip(names, weights, strict=True)}
    own = _given_outcome(given).get("weights")
    if own:
        mine = {name: float(own.get(name, 1.0)) for name in names}
        if set(own) - set(names) or mine != trl:
            raise ValueError(
                f"the estimator's gdpo weights {dict(own)} are not TRL's reward_weights {trl}: "
                "set the weights in GRPOConfig.reward_weights only"
            )
    return trl
