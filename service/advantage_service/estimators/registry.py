"""Registries of outcome baselines and token terms, their parameters, and preset resolution.

Each estimator module registers itself with the decorator here; nothing dispatches on names
anywhere else. Parameter declarations are the single source for validation, defaults and the
``GET /v1/estimators`` listing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
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
    kind: type  # bool, float, str, or list (of strings)
    default: Any
    doc: str
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    choices: tuple[str, ...] | None = None
    nullable: bool = False
    # For a list: the most items, and the most characters of each (a request's parameters are
    # echoed in every answer and are part of the merge key).
    max_items: int = 1000
    max_length: int = 200

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
        if self.kind is list:
            return self._coerce_strings(value, where)
        number = finite_number(value, where)
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

    def _coerce_strings(self, value: Any, where: str) -> list[str]:
        """A list of non-empty strings, each at most ``max_length`` characters."""
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise RequestError(
                "invalid_parameter", f"{where} must be a list of strings", field=where
            )
        if len(value) > self.max_items:
            raise RequestError(
                "out_of_range",
                f"{where} has {len(value)} items; the most is {self.max_items}",
                field=where,
            )
        for item in value:
            if not item.strip() or len(item) > self.max_length:
                raise RequestError(
                    "out_of_range",
                    f"{where} items must be non-blank and at most {self.max_length} "
                    f"characters, got {item!r}",
                    field=where,
                )
        return list(value)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "type": {bool: "boolean", float: "number", str: "string", list: "array"}[self.kind],
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


def finite_number(value: Any, where: str) -> float:
    """``value``, a JSON number, as a finite float; raises RequestError naming ``where``
    (``invalid_parameter`` for what is not a number, ``out_of_range`` for one that is not
    finite)."""
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
    return number


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
    """An outcome's result with diagnostics: ``advantage`` is a_it, (N,), for an outcome that is
    per token (in place of a_i broadcast over the rollout's tokens; a float32 tensor is handed
    over: the pipeline writes into it), else a_i, float64 (B,); ``diagnostics``: name -> (N,)
    each, or a function that computes it (called only when the request returns it).
    ``scalars``: for an outcome per token, each rollout's mean a_it, float64 (B,), when the
    outcome has it at hand (else the pipeline takes the means)."""

    advantage: torch.Tensor
    diagnostics: dict[str, torch.Tensor | Callable[[], torch.Tensor]] = field(default_factory=dict)
    scalars: torch.Tensor | None = None


OutcomeFn = Callable[[RolloutBatch, Mapping[str, Any]], torch.Tensor | OutcomeOutput]
# Checks of a batch an outcome refuses beyond its inputs (e.g. rewards out of its domain):
# raises RequestError naming the group, rollout and field.
BatchCheck = Callable[[RolloutBatch, Mapping[str, Any]], None]


@dataclass(frozen=True)
class Outcome:
    """An outcome baseline. ``fn(batch, params)`` returns a_i, float64 (B,), or an
    :class:`OutcomeOutput` (with a_it (N,) for an outcome that is per token, ``per_token``).

    ``requires(params)`` maps each batch input it needs to a field name for errors (see
    :class:`Term`); ``optional``: the inputs it reads when the request gives them;
    ``check_batch``: what else of a batch it refuses (checked before computing)."""

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
    check_batch: BatchCheck | None = None


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
    check_batch: BatchCheck | None = None,
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
            check_batch,
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
    and/or an ``amplification`` k, float32 (N,) (>= 0), applied after whitening and clipping:
    A_it <- A_it + ``amplification_scale`` k_it |A_it|; and/or a ``mask``, bool (N,), applied
    last: A_it <- m_it A_it, so that a masked token carries no gradient whatever the other
    terms gave it.

    ``state``: what the term's :class:`~.state.TermState` writes need from this computation
    (opaque to every other layer; None for a term that keeps no state)."""

    weight: torch.Tensor | None = None
    bonus: torch.Tensor | None = None
    amplification: torch.Tensor | None = None
    amplification_scale: float = 1.0
    # The diagnostic that returns what the amplification added (scale k_it |A_it|), if any.
    amplification_diagnostic: str | None = None
    mask: torch.Tensor | None = None
    diagnostics: dict[str, torch.Tensor] = field(default_factory=dict)
    state: Any = None


TermFn = Callable[[RolloutBatch, Mapping[str, Any], TermContext], TermOutput]
TermCheck = Callable[[Mapping[str, Any], str], None]
# An input a term can make itself when the request lacks it, from the token ids and what each
# id decodes to alone (``vocabulary[id]``, the server's tokenizer): returns float32 (N,).
Derive = Callable[[RolloutBatch, Mapping[str, Any], Sequence[str]], torch.Tensor]


@dataclass(frozen=True)
class Derivation:
    """How a term makes an input it needs (``derive``) when the server has a tokenizer;
    ``how``: a phrase for errors and the listing (what a request without it needs)."""

    derive: Derive
    how: str


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
    derives: Mapping[str, Derivation] = field(default_factory=dict)


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
    derives: Mapping[str, Derivation] | None = None,
) -> Callable[[TermFn], TermFn]:
    """``requires(params)`` maps each batch input the term needs (a per-token input's name, as
    ``RolloutBatch.has_input`` takes it: ``logprobs``, ``entropy``, ..., or
    ``teacher:<condition>``) to the request field naming it in errors (``logprobs``,
    ``teacher_logprobs.<condition>``); ``optional``: the fields it reads when given; ``state``:
    what the term keeps across requests (:mod:`.state`); ``derives``: the inputs of
    ``requires`` it can make from the token ids with the server's tokenizer."""

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
            dict(derives or {}),
        )
        return fn

    return decorate
