"""Estimator specifications: presets and partial objects resolved to one full, checked form."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import RequestError, shown
from .registry import OUTCOMES, TERMS, Param, resolve_params

_V = TypeVar("_V")

DEFAULT_PRESET = "grpo"
TOP_LEVEL_PARAMS = (
    Param(
        "whiten",
        bool,
        None,
        "whiten token advantages over the request: (A - mean) / "
        "sqrt(var + 1e-8); null: the outcome's default (true only for reinforce_pp_baseline)",
        nullable=True,
    ),
    Param(
        "clip",
        float,
        None,
        "clip token advantages to [-clip, clip] (null: no clip)",
        minimum=0.0,
        exclusive_minimum=True,
        nullable=True,
    ),
)


def presets() -> dict[str, dict[str, Any]]:
    """Preset name -> partial estimator object. Outcome names are presets of themselves; each
    term is a preset of GRPO plus that term with its defaults."""
    out: dict[str, dict[str, Any]] = {name: {"outcome": name} for name in OUTCOMES}
    out.update({name: {"outcome": "grpo", name: {}} for name in TERMS})
    return out


@dataclass(frozen=True)
class EstimatorSpec:
    """A resolved estimator: outcome baseline with parameters, enabled terms, whiten, clip."""

    outcome: str
    outcome_params: dict[str, Any]
    terms: dict[str, dict[str, Any]] = field(default_factory=dict)
    whiten: bool = False
    clip: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"outcome": {"name": self.outcome, **self.outcome_params}}
        for name in TERMS:
            out[name] = dict(self.terms[name]) if name in self.terms else None
        out["whiten"] = self.whiten
        out["clip"] = self.clip
        return out

    @property
    def label(self) -> str:
        """A short name for metrics and logs: 'outcome+terms' ('grpo+ktae' for the ktae preset),
        the same whichever preset or object named it, and few values whatever the parameters."""
        return "+".join([self.outcome, *self.terms])


def _named(table: Mapping[str, _V], name: str, what: str, listed: str, field: str) -> _V:
    """``table[name]``; a name the table lacks is refused (``unknown_estimator`` on ``field``,
    its names listed as ``listed``)."""
    if name not in table:
        raise RequestError(
            "unknown_estimator",
            f"unknown {what} {shown(name)}; {listed}: {sorted(table)}",
            field=field,
        )
    return table[name]


def resolve_estimator(spec: str | Mapping[str, Any] | EstimatorSpec | None) -> EstimatorSpec:
    """The full estimator for a preset name, a partial object, or None (the default preset)."""
    if isinstance(spec, EstimatorSpec):
        return spec
    if spec is None:
        spec = DEFAULT_PRESET
    if isinstance(spec, str):
        spec = _named(presets(), spec, "estimator", "presets", "estimator")
    if not isinstance(spec, Mapping):
        raise RequestError(
            "invalid_parameter", "estimator must be a preset name or an object", field="estimator"
        )
    allowed = {"outcome", "whiten", "clip", *TERMS}
    for key in spec:
        if key not in allowed:
            raise RequestError(
                "unknown_parameter",
                f"estimator has no field {shown(key)}; known: {sorted(allowed)}",
                field=f"estimator.{key}",
            )
    outcome_spec = spec.get("outcome", DEFAULT_PRESET)
    if isinstance(outcome_spec, str):
        outcome_spec = {"name": outcome_spec}
    if not isinstance(outcome_spec, Mapping) or not isinstance(outcome_spec.get("name"), str):
        raise RequestError(
            "invalid_parameter",
            "estimator.outcome must be a name or an object with a name",
            field="estimator.outcome",
        )
    name = outcome_spec["name"]
    outcome = _named(OUTCOMES, name, "outcome baseline", "known", "estimator.outcome.name")
    outcome_params = resolve_params(
        outcome.params, outcome_spec, "estimator.outcome", skip=("name",)
    )
    terms: dict[str, dict[str, Any]] = {}
    for term_name, term in TERMS.items():
        given = spec.get(term_name)
        if given is None or given is False:
            continue
        if given is True:
            given = {}
        if not isinstance(given, Mapping):
            raise RequestError(
                "invalid_parameter",
                f"estimator.{term_name} must be an object, true, or null",
                field=f"estimator.{term_name}",
            )
        params = resolve_params(term.params, given, f"estimator.{term_name}")
        if term.check is not None:
            term.check(params, f"estimator.{term_name}")
        terms[term_name] = params
    top = resolve_params(
        TOP_LEVEL_PARAMS, {k: spec[k] for k in ("whiten", "clip") if k in spec}, "estimator"
    )
    whiten = outcome.whiten_default if top["whiten"] is None else top["whiten"]
    return EstimatorSpec(name, outcome_params, terms, whiten, top["clip"])
