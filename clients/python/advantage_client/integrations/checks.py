"""Estimators checked against the service's listing (``GET /v1/estimators``) when an integration
is set up, so that a misspelt name, an unknown or out-of-range parameter, or an input the
trainer cannot give fails at once, not at the first training step after model load and
generation. numpy-free and trainer-free: trainer integrations share it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TOP_LEVEL = ("outcome", "whiten", "clip")
# Term parameters that name teacher conditions (the inputs they need follow their values).
CONDITION_PARAMS = ("positive", "negative", "teacher")


class EstimatorConfigError(ValueError):
    """An estimator the service would refuse, found before training starts."""


def _check_value(where: str, spec: Mapping[str, Any], value: Any) -> None:
    kind = spec.get("type")
    if value is None:
        if not spec.get("nullable"):
            raise EstimatorConfigError(f"{where} may not be null")
        return
    ok = {
        "boolean": isinstance(value, bool),
        "number": isinstance(value, int | float) and not isinstance(value, bool),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "string": isinstance(value, str),
    }.get(str(kind), True)
    if not ok:
        raise EstimatorConfigError(f"{where} must be a {kind}, got {value!r}")
    choices = spec.get("choices")
    if choices is not None and value not in choices:
        raise EstimatorConfigError(f"{where} must be one of {choices}, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    low, high = spec.get("minimum"), spec.get("maximum")
    if low is not None and value < low:
        raise EstimatorConfigError(f"{where} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise EstimatorConfigError(f"{where} must be <= {high}, got {value}")
    strict = spec.get("exclusive_minimum")
    if strict is not None and value <= strict:
        raise EstimatorConfigError(f"{where} must be > {strict}, got {value}")


def _params(where: str, specs: list[Mapping[str, Any]], given: Mapping[str, Any]) -> dict[str, Any]:
    by_name = {p["name"]: p for p in specs}
    for key in given:
        if key not in by_name:
            raise EstimatorConfigError(
                f"{where} has no parameter {key!r}; its parameters: {sorted(by_name)}"
            )
    out = {}
    for name, spec in by_name.items():
        value = given.get(name, spec.get("default"))
        _check_value(f"{where}.{name}", spec, value)
        out[name] = value
    return out


def resolve(estimator: Any, listing: Mapping[str, Any]) -> dict[str, Any]:
    """``estimator`` (a preset name or an object) as the full object, checked against
    ``listing``; raises :class:`EstimatorConfigError` naming what the service would refuse."""
    presets = listing.get("presets") or {}
    if isinstance(estimator, str):
        if estimator not in presets:
            raise EstimatorConfigError(
                f"unknown estimator {estimator!r}; the service's presets: {sorted(presets)}"
            )
        found = presets[estimator]
        return dict(found) if isinstance(found, Mapping) else {"outcome": {"name": estimator}}
    if not isinstance(estimator, Mapping):
        raise EstimatorConfigError(f"an estimator is a preset name or an object, got {estimator!r}")
    outcomes = {o["name"]: o for o in listing.get("outcomes", [])}
    terms = {t["name"]: t for t in listing.get("terms", [])}
    options = {o["name"]: o for o in listing.get("options", [])}
    for key in estimator:
        if key not in (*TOP_LEVEL, *terms):
            raise EstimatorConfigError(
                f"estimator has no field {key!r}; known: {sorted((*TOP_LEVEL, *terms))}"
            )
    outcome = estimator.get("outcome", listing.get("default", "grpo"))
    outcome = {"name": outcome} if isinstance(outcome, str) else dict(outcome or {})
    name = outcome.pop("name", None)
    if name not in outcomes:
        raise EstimatorConfigError(
            f"unknown outcome baseline {name!r}; the service's: {sorted(outcomes)}"
        )
    full: dict[str, Any] = {
        "outcome": {
            "name": name,
            **_params("estimator.outcome", outcomes[name]["parameters"], outcome),
        }
    }
    for term, spec in terms.items():
        given = estimator.get(term)
        if given is None or given is False:
            full[term] = None
            continue
        if given is True:
            given = {}
        if not isinstance(given, Mapping):
            raise EstimatorConfigError(f"estimator.{term} must be an object, true or null")
        full[term] = _params(f"estimator.{term}", spec["parameters"], given)
    for option, spec in options.items():
        value = estimator.get(option, spec.get("default"))
        _check_value(f"estimator.{option}", spec, value)
        full[option] = value
    return full


def required_inputs(full: Mapping[str, Any], listing: Mapping[str, Any]) -> set[str]:
    """The rollout inputs the resolved estimator needs (``logprobs``, ``sum_pi_squared``,
    ``teacher_logprobs.<condition>``, ...), its teacher conditions named by its parameters."""
    components = {c["name"]: c for c in (*listing.get("outcomes", []), *listing.get("terms", []))}
    outcome = full.get("outcome") or {}
    parts: list[tuple[str, Mapping[str, Any]]] = [(outcome.get("name", "grpo"), outcome)]
    parts += [(k, v) for k, v in full.items() if k not in TOP_LEVEL and isinstance(v, Mapping)]
    needs: set[str] = set()
    for name, params in parts:
        listed = components.get(name, {})
        conditions = [params[p] for p in CONDITION_PARAMS if isinstance(params.get(p), str)]
        for item in listed.get("inputs", []):
            if item.startswith("teacher_logprobs.") and conditions:
                continue
            needs.add(item)
        needs.update(f"teacher_logprobs.{c}" for c in conditions)
    return needs


def uses_history(full: Mapping[str, Any]) -> bool:
    """Whether the resolved estimator keeps per-prompt history (KTAE ``history != "none"``)."""
    return any(
        isinstance(v, Mapping) and v.get("history") not in (None, "none")
        for k, v in full.items()
        if k not in TOP_LEVEL
    )
