"""Registries of outcome baselines and token terms, their parameters, and preset resolution.

Each estimator module registers itself with the decorator here; nothing dispatches on names
anywhere else. Parameter declarations are the single source for validation, defaults and the
``GET /v1/estimators`` listing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..batch import RolloutBatch
from ..errors import RequestError, shown
from .state import PendingRead, TermState


@dataclass(frozen=True)
class Param:
    """One estimator parameter: its type, default and allowed range."""

    name: str
    kind: type  # bool, float or str
    default: Any
    doc: str
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    choices: tuple[str, ...] | None = None
    nullable: bool = False

    def coerce(self, value: Any, where: str) -> Any:
        """``value`` checked against this parameter; raises RequestError naming ``where``."""
        if value is None:
            if self.nullable:
                return None
            raise RequestError("invalid_parameter", f"{where} may not be null", field=where)
        if self.kind is bool:
            if not isinstance(value, bool):
                raise RequestError(
                    "invalid_parameter",
                    f"{where} must be true or false, got {shown(value)}",
                    field=where,
                )
            return value
        if self.kind is str:
            if not isinstance(value, str):
                raise RequestError(
                    "invalid_parameter",
                    f"{where} must be a string, got {shown(value)}",
                    field=where,
                )
            if self.choices is not None and value not in self.choices:
                raise RequestError(
                    "out_of_range",
                    f"{where} must be one of {list(self.choices)}, got {shown(value)}",
                    field=where,
                )
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RequestError(
                "invalid_parameter", f"{where} must be a number, got {shown(value)}", field=where
            )
        try:
            number = float(value)
        except OverflowError:  # a JSON integer beyond float range
            number = math.inf
        if not math.isfinite(number):
            raise RequestError(
                "out_of_range", f"{where} must be finite, got {shown(value)}", field=where
            )
        if self.minimum is not None and (
            number < self.minimum or (self.exclusive_minimum and number == self.minimum)
        ):
            bound = ">" if self.exclusive_minimum else ">="
            raise RequestError(
                "out_of_range",
                f"{where} must be {bound} {self.minimum:g}, got {shown(value)}",
                field=where,
            )
        if self.maximum is not None and number > self.maximum:
            raise RequestError(
                "out_of_range",
                f"{where} must be <= {self.maximum:g}, got {shown(value)}",
                field=where,
            )
        return number

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "type": {bool: "boolean", float: "number", str: "string"}[self.kind],
            "default": self.default,
            "description": self.doc,
            "nullable": self.nullable,
        }
        if self.minimum is not None:
            out["exclusive_minimum" if self.exclusive_minimum else "minimum"] = self.minimum
        if self.maximum is not None:
            out["maximum"] = self.maximum
        if self.choices is not None:
            out["choices"] = list(self.choices)
        return out


def resolve_params(
    params: tuple[Param, ...], given: Mapping[str, Any], where: str, skip: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Defaults merged with ``given``; unknown names and bad values raise RequestError."""
    known = {p.name: p for p in params}
    for name in given:
        if name not in known and name not in skip:
            raise RequestError(
                "unknown_parameter",
                f"{where} has no parameter {shown(name)}; known: {sorted(known) or 'none'}",
                field=f"{where}.{name}",
            )
    return {
        p.name: p.coerce(given[p.name], f"{where}.{p.name}") if p.name in given else p.default
        for p in params
    }


# ---- outcome baselines ---------------------------------------------------------------------------

Requires = Callable[[Mapping[str, Any]], dict[str, str]]


def requires_nothing(params: Mapping[str, Any]) -> dict[str, str]:
    return {}


@dataclass
class OutcomeOutput:
    """A per-token outcome's result: a_it, float64 (N,), in place of a_i broadcast over the
    rollout's tokens, and its diagnostics ((N,) each)."""

    advantage: torch.Tensor
    diagnostics: dict[str, torch.Tensor] = field(default_factory=dict)


OutcomeFn = Callable[[RolloutBatch, Mapping[str, Any]], torch.Tensor | OutcomeOutput]


@dataclass(frozen=True)
class Outcome:
    """An outcome baseline. ``fn(batch, params)`` returns a_i, float64 (B,), or, for an outcome
    that is per token (``per_token``), an :class:`OutcomeOutput` with a_it (N,).

    ``requires(params)`` maps each batch input it needs to a field name for errors (see
    :class:`Term`); ``optional``: the inputs it reads when the request gives them."""

    name: str
    fn: OutcomeFn
    params: tuple[Param, ...]
    doc: str
    formula: str
    paper: str
    whiten_default: bool = False
    min_group_size: int = 1
    per_token: bool = False
    diagnostics: tuple[str, ...] = ()
    requires: Requires = requires_nothing
    optional: tuple[str, ...] = ()


OUTCOMES: dict[str, Outcome] = {}


def register_outcome(
    name: str,
    *,
    formula: str,
    paper: str,
    params: tuple[Param, ...] = (),
    whiten_default: bool = False,
    min_group_size: int = 1,
    per_token: bool = False,
    diagnostics: tuple[str, ...] = (),
    requires: Requires = requires_nothing,
    optional: tuple[str, ...] = (),
) -> Callable[[OutcomeFn], OutcomeFn]:
    def decorate(fn: OutcomeFn) -> OutcomeFn:
        OUTCOMES[name] = Outcome(
            name,
            fn,
            params,
            (fn.__doc__ or "").strip().split("\n")[0],
            formula,
            paper,
            whiten_default,
            min_group_size,
            per_token,
            diagnostics,
            requires,
            optional,
        )
        return fn

    return decorate


# ---- token terms ---------------------------------------------------------------------------------


@dataclass
class TermContext:
    """Request-level inputs a term may need besides the batch and its own parameters."""

    ignore_token_ids: torch.Tensor | None = None  # int64 (K,) on the batch's device
    vocab_size: int | None = None
    # The diagnostics the request returns: a term may skip computing the others.
    diagnostics: frozenset[str] = frozenset()
    # What the engine read for each term that keeps state (term name -> its prior, possibly
    # still in flight). A term sees its own as ``read``.
    reads: Mapping[str, PendingRead[Any]] = field(default_factory=dict)
    # This term's read (set per term by the pipeline); None: it read nothing for this request.
    read: PendingRead[Any] | None = None

    def waits(self, term: str) -> bool:
        """True when ``term`` will wait for a read still in flight: the pipeline computes it
        after the others, so that they overlap the read."""
        read = self.reads.get(term)
        return read is not None and not read.done()

    def for_term(self, term: str) -> TermContext:
        """The context ``term`` computes with: its own read as ``read``."""
        return replace(self, read=self.reads.get(term))


@dataclass
class TermOutput:
    """What a term contributes: a multiplicative credit weight and/or an additive bonus, (N,);
    and/or a ``mask``, bool (N,), applied last (after whitening and clipping): A_it <- m_it
    A_it, so that a masked token carries no gradient whatever the other terms gave it.

    ``state``: what the term's :class:`~.state.TermState` writes need from this computation
    (opaque to every other layer; None for a term that keeps no state)."""

    weight: torch.Tensor | None = None
    bonus: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    diagnostics: dict[str, torch.Tensor] = field(default_factory=dict)
    state: Any = None


TermFn = Callable[[RolloutBatch, Mapping[str, Any], TermContext], TermOutput]
TermCheck = Callable[[Mapping[str, Any], str], None]


@dataclass(frozen=True)
class Term:
    """A per-token credit term: ``fn(batch, params, ctx) -> TermOutput``; ``state`` declares
    what it keeps across requests (None: nothing); ``optional``: the inputs it reads when the
    request gives them."""

    name: str
    fn: TermFn
    params: tuple[Param, ...]
    doc: str
    formula: str
    paper: str
    diagnostics: tuple[str, ...]
    requires: Requires
    check: TermCheck | None = None
    state: TermState[Any] | None = None
    optional: tuple[str, ...] = ()


TERMS: dict[str, Term] = {}


def register_term(
    name: str,
    *,
    formula: str,
    paper: str,
    params: tuple[Param, ...],
    diagnostics: tuple[str, ...],
    requires: Requires,
    check: TermCheck | None = None,
    state: TermState[Any] | None = None,
    optional: tuple[str, ...] = (),
) -> Callable[[TermFn], TermFn]:
    """``requires(params)`` maps each batch input the term needs (a per-token input's name, as
    ``RolloutBatch.has_input`` takes it: ``logprobs``, ``entropy``, ..., or
    ``teacher:<condition>``) to the request field naming it in errors (``logprobs``,
    ``teacher_logprobs.<condition>``); ``optional``: the fields it reads when given; ``state``:
    what the term keeps across requests (:mod:`.state`)."""

    def decorate(fn: TermFn) -> TermFn:
        TERMS[name] = Term(
            name,
            fn,
            params,
            (fn.__doc__ or "").strip().split("\n")[0],
            formula,
            paper,
            diagnostics,
            requires,
            check,
            state,
            optional,
        )
        return fn

    return decorate
