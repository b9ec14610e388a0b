"""An estimator checked against the service's listing (``GET /v1/estimators``, or the registry
in-process) before a trainer starts, so that a misspelt name, an unknown parameter or a value out
of range fails when the trainer is built, not at its first step after model load and generation.

The listing names every preset (resolved), outcome and term with its parameters (type, range,
choices) and the inputs it needs at its default parameters; :func:`resolve` follows the
service's own resolution of a preset or a partial object onto that listing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

TOP_LEVEL = ("outcome", "whiten", "clip")


class EstimatorCheckError(ValueError):
    """An estimator the service would refuse, named before the first step."""


def _check_value(param: Mapping[str, Any], value: Any, where: str) -> None:
    kind = param.get("type")
    if value is None:
        if not param.get("nullable"):
            raise EstimatorCheckError(f"{where} may not be null")
        return
    if kind == "boolean":
        if not isinstance(value, bool):
            raise EstimatorCheckError(f"{where} must be true or false, got {value!r}")
        return
    if kind == "string":
        if not isinstance(value, str):
            raise EstimatorCheckError(f"{where} must be a string, got {value!r}")
        choices = param.get("choices")
        if choices is not None and value not in choices:
            raise EstimatorCheckError(f"{where} must be one of {list(choices)}, got {value!r}")
        return
    if kind == "object":  # (name -> number: gdpo's weights; the service checks the rest)
        if not isinstance(value, Mapping):
            raise EstimatorCheckError(f"{where} must be an object, got {value!r}")
        for name, item in value.items():
            _check_value({"type": "number"}, item, f"{where}.{name}")
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EstimatorCheckError(f"{where} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise EstimatorCheckError(f"{where} must be finite, got {value!r}")
    # (a bound the listing does not set is absent, or null in the HTTP listing's schema)
    low, above, high = (param.get(k) for k in ("minimum", "exclusive_minimum", "maximum"))
    if low is not None and number < low:
        raise EstimatorCheckError(f"{where} must be >= {low:g}, got {value!r}")
    if above is not None and number <= above:
        raise EstimatorCheckError(f"{where} must be > {above:g}, got {value!r}")
    if high is not None and number > high:
        raise EstimatorCheckError(f"{where} must be <= {high:g}, got {value!r}")


def _params(
    described: list[Mapping[str, Any]], given: Mapping[str, Any], where: str, skip: tuple[str, ...]
) -> dict[str, Any]:
    known = {p["name"]: p for p in described}
    for name in given:
        if name not in known and name not in skip:
            raise EstimatorCheckError(
                f"{where} has no parameter {name!r}; known: {sorted(known) or 'none'}"
            )
    out: dict[str, Any] = {}
    for name, param in known.items():
        if name in given:
            _check_value(param, given[name], f"{where}.{name}")
            out[name] = given[name]
        else:
            out[name] = param.get("default")
    return out


def resolve(listing: Mapping[str, Any], estimator: Any) -> dict[str, Any]:
    """The full estimator object (``{"outcome": {"name", ...params}, <term>: {...} | None,
    "whiten", "clip"}``) of a preset name or a partial object, as the service would resolve it;
    raises :class:`EstimatorCheckError` naming what it would refuse."""
    presets: Mapping[str, Any] = listing.get("presets") or {}
    outcomes = {o["name"]: o for o in listing.get("outcomes", ())}
    terms = {t["name"]: t for t in listing.get("terms", ())}
    if estimator is None:
        estimator = listing.get("default", "grpo")
    if isinstance(estimator, str):
        if estimator not in presets:
            raise EstimatorCheckError(
                f"unknown estimator {estimator!r}; the service's presets: {sorted(presets)}"
            )
        return dict(presets[estimator])
    if not isinstance(estimator, Mapping):
        raise EstimatorCheckError(
            f"estimator must be a preset name or an object, got {type(estimator).__name__}"
        )
    allowed = {*TOP_LEVEL, *terms}
    for key in estimator:
        if key not in allowed:
            raise EstimatorCheckError(f"estimator has no field {key!r}; known: {sorted(allowed)}")
    outcome = estimator.get("outcome", listing.get("default", "grpo"))
    if isinstance(outcome, str):
        outcome = {"name": outcome}
    if not isinstance(outcome, Mapping) or not isinstance(outcome.get("name"), str):
        raise EstimatorCheckError("estimator.outcome must be a name or an object with a name")
    name = outcome["name"]
    if name not in outcomes:
        raise EstimatorCheckError(
            f"unknown outcome baseline {name!r}; the service's outcomes: {sorted(outcomes)}"
        )
    resolved: dict[str, Any] = {
        "outcome": {
            "name": name,
            **_params(
                outcomes[name].get("parameters", []), outcome, "estimator.outcome", ("name",)
            ),
        }
    }
    for term_name, term in terms.items():
        given = estimator.get(term_name)
        if given is None or given is False:
            resolved[term_name] = None
            continue
        if given is True:
            given = {}
        if not isinstance(given, Mapping):
            raise EstimatorCheckError(f"estimator.{term_name} must be an object, true, or null")
        resolved[term_name] = _params(
            term.get("parameters", []), given, f"estimator.{term_name}", ()
        )
    options = {p["name"]: p for p in listing.get("options", ())}
    for key in ("whiten", "clip"):
        if key in estimator and key in options:
            _check_value(options[key], estimator[key], f"estimator.{key}")
    whiten = estimator.get("whiten")
    resolved["whiten"] = bool(outcomes[name].get("whiten_default")) if whiten is None else whiten
    resolved["clip"] = estimator.get("clip")
    return resolved


def _parts(
    listing: Mapping[str, Any], resolved: Mapping[str, Any]
) -> list[tuple[Mapping[str, Any], Mapping[str, Any]]]:
    """(the listing's entry, the estimator's parameters) of the outcome and each enabled term."""
    outcomes = {o["name"]: o for o in listing.get("outcomes", ())}
    terms = {t["name"]: t for t in listing.get("terms", ())}
    outcome = resolved.get("outcome") or {}
    name = outcome.get("name") if isinstance(outcome, Mapping) else outcome
    parts: list[tuple[Mapping[str, Any], Mapping[str, Any]]] = []
    if name in outcomes:
        parts.append((outcomes[name], outcome if isinstance(outcome, Mapping) else {}))
    for term_name, params in resolved.items():
        if term_name in terms and params:
            parts.append((terms[term_name], params))
    return parts


def required_inputs(listing: Mapping[str, Any], resolved: Mapping[str, Any]) -> set[str]:
    """The inputs the resolved estimator cannot do without, by ``compute_padded`` keyword:
    ``logprobs``, ``entropy``, ``sum_pi_squared``, ``teacher_logprobs.<condition>``. A
    teacher's condition follows the term's parameters (CSCR's ``positive``/``negative``,
    OPSD's ``teacher``), the rest is the listing's ``inputs`` of each part."""
    needed: set[str] = set()
    for part, params in _parts(listing, resolved):
        for field in part.get("inputs", ()):
            if field.startswith("teacher_logprobs."):
                condition = field.split(".", 1)[1]
                # (the default condition names are the defaults of the parameters naming them)
                for param in part.get("parameters", ()):
                    if param.get("default") == condition and param["name"] in params:
                        condition = str(params[param["name"]])
                        break
                field = f"teacher_logprobs.{condition}"
            needed.add(field)
    return needed


def optional_inputs(listing: Mapping[str, Any], resolved: Mapping[str, Any]) -> set[str]:
    """The inputs the resolved estimator reads when given and does without otherwise (OTB's
    ``is_weights`` and ``returns``, ...), by ``compute_padded`` keyword: a trainer that has
    one sends it, or its answer would differ from the trainer's own estimator's."""
    return {
        field for part, _ in _parts(listing, resolved) for field in part.get("optional_inputs", ())
    }


def inputs_read(listing: Mapping[str, Any], resolved: Mapping[str, Any]) -> set[str]:
    """Every input the resolved estimator reads, required or optional, by ``compute_padded``
    keyword (``teacher_logprobs`` for any teacher condition)."""
    both = required_inputs(listing, resolved) | optional_inputs(listing, resolved)
    return {field.split(".", 1)[0] for field in both}


def is_token_level(listing: Mapping[str, Any], resolved: Mapping[str, Any]) -> bool:
    """Whether the estimator's advantages vary within a completion (a term, or an outcome per
    token such as OTB)."""
    outcomes = {o["name"]: o for o in listing.get("outcomes", ())}
    outcome = resolved.get("outcome") or {}
    name = outcome.get("name") if isinstance(outcome, Mapping) else outcome
    if bool(outcomes.get(name, {}).get("per_token")):
        return True
    return any(k not in TOP_LEVEL and v for k, v in resolved.items())


def uses_history(resolved: Mapping[str, Any]) -> bool:
    """Whether the resolved estimator keeps per-prompt history (a term whose ``history`` is not
    ``none``)."""
    return any(
        isinstance(v, Mapping) and v.get("history") not in (None, "none")
        for k, v in resolved.items()
        if k not in TOP_LEVEL
    )
