"""Trainers' (B, T) padded tensors and the service's flat layout, both ways, with numpy only.

A rollout's tokens are the positions where its row of ``mask`` is true, in order: left
padding, right padding and holes (a multi-turn response's tool output) all work. Rows of one
group need not be adjacent: ``group_ids`` (B,) names each row's group, in any order, and the
flat batch keeps the trainer's row order (the service numbers groups itself). Every step is one
vectorised numpy operation over the whole batch: no Python loop over rows, groups or tokens.

:class:`PaddedLayout` is what the in-process API and both clients share: ``gather`` a (B, T)
array into the flat (N,) order, ``scatter`` a flat (N,) result back into (B, T) with exact zeros
off the mask, and ``broadcast`` per-row values over the mask (an estimator with no token-level
term needs nothing more).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import arrays as _arrays
from . import flat as _flat
from .errors import AdvantageError
from .fields import REWARD_COMPONENTS_FIELD, TOKEN_FIELDS
from .methods import OUTCOME_ONLY_PRESETS
from .rewards import check_component_count, check_component_name

# The per-token inputs of compute_padded, by keyword (their names on every wire too).
PER_TOKEN_INPUTS = TOKEN_FIELDS
# Outcome baselines: an estimator that is one of these (and has no term) needs no token ids.
OUTCOME_PRESETS = frozenset(OUTCOME_ONLY_PRESETS)
ESTIMATOR_TOP_LEVEL = frozenset(("outcome", "whiten", "clip"))


@dataclass
class PaddedResult:
    """What ``compute_padded`` returns: ``advantages`` (B, T) float32, exactly 0 where the mask
    is false; ``scalars`` (B,) float32, each rollout's outcome scalar; ``diagnostics``, name ->
    (B, T) float32 for each diagnostic asked for. numpy arrays from the clients; torch tensors
    on the input's device from ``advantage_service.compute_padded`` given torch tensors."""

    advantages: Any
    scalars: Any
    diagnostics: dict[str, Any] = field(default_factory=dict)
    # The response's summary (``compute_ms``, ``history``, ...): empty in-process, where no
    # service answered.
    summary: dict[str, Any] = field(default_factory=dict)


def as_numpy(values: Any, name: str = "values") -> np.ndarray:
    """``values`` (numpy, torch on any device, JAX, anything with ``__array__`` or DLPack) as
    a numpy array, half precision widened to float32, without a copy where the source allows
    it: :func:`.arrays.to_numpy`."""
    return _arrays.to_numpy(values, name)


def group_index_of(group_ids: Any) -> tuple[list[str], np.ndarray]:
    """(the distinct group ids as strings, int64 (B,) index of each row's group into them).

    ``group_ids`` (B,): strings, integers, or an object array (uuids, anything ``str`` names);
    ids that print the same are one group."""
    ids = as_numpy(group_ids, "group_ids")
    if ids.ndim != 1:
        raise AdvantageError(
            "invalid_shape",
            f"group_ids must be one-dimensional (one per row), got shape {ids.shape}",
            field="group_ids",
        )
    if ids.dtype.kind not in "iuUS":
        ids = ids.astype(str)  # str() of each element, in C: uuids, mixed objects
    distinct, index = np.unique(ids, return_inverse=True)
    names = distinct.astype(str).tolist()
    return names, index.reshape(-1).astype(np.int64, copy=False)


def needs_token_ids(estimator: Any) -> bool:
    """False for an estimator known to have no token-level term (an outcome preset, or an
    object without a term); True otherwise, the safe answer for names this client does not
    know (the per-token path is correct for every estimator, only slower)."""
    if estimator is None:
        return False
    if isinstance(estimator, str):
        return estimator not in OUTCOME_PRESETS
    if isinstance(estimator, Mapping):
        outcome = estimator.get("outcome")
        name = outcome.get("name") if isinstance(outcome, Mapping) else outcome
        if name is not None and name not in OUTCOME_PRESETS:  # (per token, like otb, or unknown)
            return True
        return any(
            key not in ESTIMATOR_TOP_LEVEL and value is not None and value is not False
            for key, value in estimator.items()
        )
    return True


@dataclass
class PaddedLayout:
    """Where a (B, T) batch's rollouts lie: ``mask`` bool (B, T), ``lengths`` int64 (B,),
    ``offsets`` int64 (B+1,), and the groups (``group_ids`` G strings, ``group_index`` int64
    (B,) in row order)."""

    mask: np.ndarray
    lengths: np.ndarray
    offsets: np.ndarray
    group_ids: list[str]
    group_index: np.ndarray
    rewards: np.ndarray

    @classmethod
    def from_padded(cls, mask: Any, rewards: Any, group_ids: Any) -> PaddedLayout:
        """Check shapes and build the layout; raises :class:`AdvantageError` naming the field."""
        m = as_numpy(mask, "mask")
        if m.ndim != 2:
            raise AdvantageError(
                "invalid_shape", f"mask must be (B, T), got shape {m.shape}", field="mask"
            )
        if m.dtype != np.bool_:
            m = m != 0
        r = as_numpy(rewards, "rewards")
        if r.ndim == 2 and r.shape == m.shape:
            raise AdvantageError(
                "invalid_shape",
                "rewards must be (B,), one per row; sum token-level rewards first "
                "(rewards.sum(-1))",
                field="rewards",
            )
        if r.shape != (m.shape[0],):
            raise AdvantageError(
                "invalid_shape",
                f"rewards must have shape ({m.shape[0]},), got {r.shape}",
                field="rewards",
            )
        if r.dtype.kind not in "iuf":
            raise AdvantageError(
                "invalid_type", f"rewards must be numbers, got {r.dtype}", field="rewards"
            )
        names, index = group_index_of(group_ids)
        if index.shape != (m.shape[0],):
            raise AdvantageError(
                "invalid_shape",
                f"group_ids must have {m.shape[0]} entries (one per row), got {index.size}",
                field="group_ids",
            )
        lengths = np.count_nonzero(m, axis=1).astype(np.int64)
        offsets = np.zeros(m.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(m, lengths, offsets, names, index, r.astype(np.float64, copy=False))

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.mask.shape[0]), int(self.mask.shape[1]))

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def gather(self, values: Any, name: str) -> np.ndarray:
        """A (B, T) array's values at the mask, row after row: (N,)."""
        array = as_numpy(values, name)
        if array.shape != self.mask.shape:
            raise AdvantageError(
                "invalid_shape",
                f"{name} must have the mask's shape {self.mask.shape}, got {array.shape}",
                field=name,
            )
        return np.ascontiguousarray(array[self.mask])

    def scatter(self, flat: np.ndarray, dtype: Any = np.float32) -> np.ndarray:
        """Flat per-token values (N,) back into (B, T), exactly 0 off the mask."""
        out = np.zeros(self.mask.shape, dtype=dtype)
        out[self.mask] = flat
        return out

    def broadcast(self, per_row: np.ndarray, dtype: Any = np.float32) -> np.ndarray:
        """Per-row values (B,) over each row's mask, exactly 0 off it: (B, T)."""
        values = np.asarray(per_row, dtype=dtype)[:, None]
        return np.where(self.mask, values, np.zeros((), dtype=dtype))

    def row_values(self, flat: np.ndarray) -> np.ndarray:
        """The value of each row's first token in flat (N,) values (0 for an empty row): for
        per-token values that are constant over each row."""
        out = np.zeros(self.mask.shape[0], dtype=flat.dtype)
        nonempty = self.lengths > 0
        out[nonempty] = flat[self.offsets[:-1][nonempty]]
        return out


def padded_inputs(
    layout: PaddedLayout,
    tokens: Any,
    token_ids: bool,
    per_token: Mapping[str, Any],
    teacher_logprobs: Mapping[str, Any] | None,
) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(flat tokens (N,), flat per-token inputs by keyword, flat teacher log-probs by
    condition). Without ``token_ids`` (an estimator with no token-level term) the tokens are
    zeros: the wire needs the lengths, not the ids."""
    if token_ids:
        if tokens is None:
            raise AdvantageError(
                "missing_input", "this estimator needs the token ids (tokens)", field="tokens"
            )
        flat_tokens = layout.gather(tokens, "tokens")
        if flat_tokens.dtype.kind not in "iu":
            raise AdvantageError(
                "invalid_type", f"tokens must be integers, got {flat_tokens.dtype}", field="tokens"
            )
    else:
        flat_tokens = np.zeros(layout.num_tokens, dtype=np.int32)
    inputs = {
        name: layout.gather(values, name).astype(np.float32, copy=False)
        for name, values in per_token.items()
        if values is not None
    }
    teachers = {
        str(name): layout.gather(values, f"teacher_logprobs.{name}").astype(np.float32, copy=False)
        for name, values in (teacher_logprobs or {}).items()
    }
    return flat_tokens, inputs, teachers


def request_options(
    *,
    estimator: Any,
    diagnostics: Sequence[str],
    ignore_token_ids: Sequence[int] | None,
    namespace: str | None,
    request_id: str | None,
) -> dict[str, Any]:
    """The JSON request's top-level fields (everything but ``groups``) of a padded call:
    ``scalar`` is always returned (the result's ``.scalars``)."""
    options: dict[str, Any] = {"estimator": estimator, "return": ["scalar", *diagnostics]}
    if ignore_token_ids is not None:
        options["ignore_token_ids"] = [int(t) for t in as_numpy(ignore_token_ids).reshape(-1)]
    if namespace is not None:
        options["namespace"] = namespace
    if request_id is not None:
        options["request_id"] = request_id
    return options


def result_from_flat(
    layout: PaddedLayout,
    advantages: np.ndarray,
    scalars: np.ndarray,
    diagnostics: Mapping[str, np.ndarray],
    token_ids: bool,
    summary: Mapping[str, Any] | None = None,
) -> PaddedResult:
    """Flat (N,) results in row order as a :class:`PaddedResult`. Without ``token_ids`` every
    row's advantages are one value (no token-level term), broadcast over its mask."""
    if token_ids:
        padded = layout.scatter(advantages)
    else:
        padded = layout.broadcast(layout.row_values(advantages))
    return PaddedResult(
        advantages=padded,
        scalars=np.asarray(scalars, dtype=np.float32),
        diagnostics={name: layout.scatter(values) for name, values in diagnostics.items()},
        summary=dict(summary or {}),
    )


@dataclass
class FlatRequest:
    """A padded call as the flat arrays both wires carry, in the trainer's row order."""

    layout: PaddedLayout
    token_ids: bool
    tokens: np.ndarray  # int32/int64 (N,)
    per_token: dict[str, np.ndarray]  # keyword (logprobs, entropy, ...) -> float32 (N,)
    teacher_logprobs: dict[str, np.ndarray]  # condition -> float32 (N,)
    options: dict[str, Any]  # the JSON request's top-level fields
    # Per group (layout.group_ids order): the key of its history, None for none; None: no keys.
    prompt_keys: list[str | None] | None = None
    # Component name -> float64 (B,), NaN where a row has no value.
    reward_components: dict[str, np.ndarray] = field(default_factory=dict)

    def wire(self) -> WireRequest:
        """What the wires send of this call (the layout and token ids stay to read the answer)."""
        return WireRequest(
            self.layout,
            self.tokens,
            self.per_token,
            self.teacher_logprobs,
            self.prompt_keys,
            self.options,
            self.reward_components,
        )


@dataclass
class WireRequest:
    """A request as both binary wires carry it (gRPC tensors, Arrow columns): ``rows`` where
    the rollouts lie (their groups, offsets and rewards), the flat ``tokens`` and per-token
    arrays in the wires' dtypes, the prompt keys (one per group, None: none), ``options``
    the JSON request's top-level fields (everything but ``groups``), and the reward components
    (name -> (B,), NaN where a rollout has none)."""

    rows: _flat.FlatGroups | PaddedLayout
    tokens: np.ndarray
    per_token: Mapping[str, np.ndarray]
    teacher_logprobs: Mapping[str, np.ndarray]
    prompt_keys: Sequence[str | None] | None
    options: Mapping[str, Any]
    reward_components: Mapping[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def from_json(cls, request: Mapping[str, Any]) -> WireRequest:
        """The JSON request (lists or numpy arrays inside), checked and flattened: its groups'
        rollouts in group order."""
        _flat.check_top_level(request)
        flat = _flat.flatten_groups(request.get("groups")).for_wire()
        options = {k: v for k, v in request.items() if k != "groups"}
        return cls(
            flat,
            flat.tokens,
            flat.token_values(),
            flat.teacher_logprobs,
            flat.prompt_keys,
            options,
            flat.reward_components,
        )


def group_keys(layout: PaddedLayout, prompt_keys: Any) -> list[str | None] | None:
    """``prompt_keys`` (B,) per row (strings; None for a row without one) as one key per group
    of ``layout``; the rows of a group must agree. None when not given."""
    if prompt_keys is None:
        return None
    rows = as_numpy(prompt_keys, "prompt_keys")
    if rows.shape != (layout.shape[0],):
        raise AdvantageError(
            "invalid_shape",
            f"prompt_keys must have {layout.shape[0]} entries (one per row), got shape "
            f"{rows.shape}",
            field="prompt_key",
        )
    keys = [None if k is None else str(k) for k in rows.tolist()]
    per_group = _flat.group_prompt_keys(keys, layout.group_ids, layout.group_index)
    return per_group if any(k is not None for k in per_group) else None


def unsupported_inputs(given: Mapping[str, Any], supported: Sequence[str], where: str) -> None:
    """Refuse a per-token input ``where`` (a client, this service version) cannot carry yet."""
    for name, values in given.items():
        if values is not None and name not in supported:
            raise AdvantageError(
                "unsupported_input",
                f"{name} is not accepted by {where} yet: the service's per-token inputs are "
                f"{list(supported)}; upgrade the service and client, or leave {name} out",
                field=name,
            )


def flat_request(
    tokens: Any,
    mask: Any,
    rewards: Any,
    group_ids: Any,
    *,
    estimator: Any,
    logprobs: Any,
    entropy: Any,
    sum_pi_squared: Any,
    is_weights: Any,
    teacher_logprobs: Mapping[str, Any] | None,
    diagnostics: Sequence[str],
    planning_mask: Any = None,
    ignore_token_ids: Sequence[int] | None,
    namespace: str | None,
    request_id: str | None,
    client: str,
    prompt_keys: Any = None,
    returns: Any = None,
    reward_components: Mapping[str, Any] | None = None,
) -> FlatRequest:
    """Check a padded call's arrays (per-token inputs ``client``, e.g. "the HTTP client",
    cannot carry yet are refused) and gather them into the flat layout. ``prompt_keys`` (B,):
    per row, the key of its group's history (every row of a group the same), or None."""
    per_token = {
        "logprobs": logprobs,
        "entropy": entropy,
        "sum_pi_squared": sum_pi_squared,
        "is_weights": is_weights,
        "returns": returns,
        "planning_mask": planning_mask,
    }
    unsupported_inputs(per_token, TOKEN_FIELDS, client)
    components = row_components(reward_components, int(as_numpy(mask, "mask").shape[0]))
    layout = PaddedLayout.from_padded(mask, rewards, group_ids)
    token_ids = needs_token_ids(estimator)
    flat_tokens, inputs, teachers = padded_inputs(
        layout, tokens, token_ids, per_token, teacher_logprobs
    )
    wanted = [d for d in dict.fromkeys(diagnostics) if d != "scalar"]
    return FlatRequest(
        layout=layout,
        token_ids=token_ids,
        tokens=_flat.narrow_tokens(flat_tokens),
        per_token=inputs,
        teacher_logprobs=teachers,
        options=request_options(
            estimator=estimator,
            diagnostics=wanted,
            ignore_token_ids=ignore_token_ids,
            namespace=namespace,
            request_id=request_id,
        ),
        prompt_keys=group_keys(layout, prompt_keys),
        reward_components=components,
    )


def row_components(components: Mapping[str, Any] | None, rows: int) -> dict[str, np.ndarray]:
    """A padded call's ``reward_components`` ({name: (B,)}) checked: bounded names, one number
    per row (NaN: none), as float64 arrays."""
    if components is None:
        return {}
    if not isinstance(components, Mapping):
        raise AdvantageError(
            "invalid_type",
            "reward_components must map component names to (B,) arrays",
            field=REWARD_COMPONENTS_FIELD,
        )
    check_component_count(len(components))
    out = {}
    for name, values in components.items():
        check_component_name(name)
        where = f"{REWARD_COMPONENTS_FIELD}.{name}"
        array = as_numpy(values, where)
        if array.shape != (rows,):
            raise AdvantageError(
                "invalid_shape",
                f"{where} must have shape ({rows},), one per row, got {array.shape}",
                field=where,
            )
        if array.dtype.kind not in "iuf":
            raise AdvantageError(
                "invalid_type", f"{where} must be numbers, got {array.dtype}", field=where
            )
        array = array.astype(np.float64, copy=False)
        infinite = np.flatnonzero(np.isinf(array))
        if infinite.size:
            row = int(infinite[0])
            raise AdvantageError(
                "invalid_value",
                f"{where} of row {row} is {array[row]}; it must be finite (NaN where the row has "
                "none)",
                field=where,
            )
        out[name] = array
    return out
