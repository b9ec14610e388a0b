"""What ``GET /v1/estimators`` (and gRPC's ``ListEstimators``) lists: every outcome, term, preset
and parameter, read from the registry. The client package's table of methods and their inputs is
generated from it (``clients/python/generate_methods.py``)."""

from __future__ import annotations

from typing import Any

from advantage_contract import CONTRACT_VERSION

from ..estimators import OUTCOMES, TERMS, Param, presets, resolve_estimator
from ..estimators.pipeline import all_diagnostics
from ..estimators.spec import DEFAULT_PRESET, TOP_LEVEL_PARAMS


def default_params(params: tuple[Param, ...]) -> dict[str, Any]:
    return {p.name: p.default for p in params}


def estimator_listing() -> dict[str, Any]:
    """Every outcome, term, preset and parameter, from the registry (with the inputs each
    needs: its ``requires`` at its default parameters)."""
    return {
        "contract": CONTRACT_VERSION,
        "default": DEFAULT_PRESET,
        "presets": {name: resolve_estimator(name).to_dict() for name in presets()},
        "outcomes": [
            {
                "name": o.name,
                "description": o.doc,
                "formula": o.formula,
                "paper": o.paper,
                "parameters": [p.describe() for p in o.params],
                "whiten_default": o.whiten_default,
                "min_group_size": o.min_group_size,
                "per_token": o.per_token,
                "diagnostics": list(o.diagnostics),
                "inputs": list(o.requires(default_params(o.params)).values()),
                "optional_inputs": list(o.optional),
            }
            for o in OUTCOMES.values()
        ],
        "terms": [
            {
                "name": t.name,
                "description": t.doc,
                "formula": t.formula,
                "paper": t.paper,
                "parameters": [p.describe() for p in t.params],
                "diagnostics": list(t.diagnostics),
                "inputs": list(t.requires(default_params(t.params)).values()),
                "optional_inputs": list(t.optional),
                # An input of ``inputs`` the service can make when a request lacks it: how.
                "derived_inputs": {name: d.how for name, d in t.derives.items()},
            }
            for t in TERMS.values()
        ],
        "options": [p.describe() for p in TOP_LEVEL_PARAMS],
        "diagnostics": list(all_diagnostics()),
    }
