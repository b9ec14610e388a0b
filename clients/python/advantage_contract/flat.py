"""The JSON request's ``groups`` as flat arrays (the service's batch layout), and back.

Flat layout: all rollouts' tokens concatenated (N,), ``offsets`` (B+1,) with rollout i owning
``tokens[offsets[i]:offsets[i + 1]]``, ``group_index`` (B,) into ``group_ids``. Both binary
wires (gRPC tensors, Arrow list columns) carry exactly these arrays.

:func:`flatten_groups` is the one builder of that layout from rollout dicts: the service decodes
JSON requests and assembles gRPC stream groups with it (and wraps its arrays into a batch), the
clients check and pack a request with it before sending, so both name a bad value alike. It needs
numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any

import numpy as np

from .arrays import is_array, to_number, to_numpy, widen
from .errors import AdvantageError
from .fields import (
    INT32_MAX,
    INT32_MIN,
    MAX_CONDITION_NAME_LENGTH,
    MAX_GROUP_ID_LENGTH,
    MAX_TEACHER_CONDITIONS,
    REWARD_COMPONENTS_FIELD,
    ROLLOUT_FIELDS,
    TOKEN_FIELDS,
    TOKEN_ID_LIMIT,
    TOP_LEVEL_FIELDS,
)
from .rewards import check_reward, component_arrays, is_integer, is_number, rollout_components


@dataclass
class FlatGroups:
    """Groups of rollouts as flat numpy arrays (rollouts in group order).

    From :func:`flatten_groups`: ``tokens`` int64 (N,), ``rewards`` float64 (B,), per-token
    values float64 (N,) when the rollouts gave lists; values given as numpy arrays keep their
    dtypes (numpy's promotion of them). :meth:`for_wire` casts to the wire's dtypes.
    ``reward_components``: name -> float64 (B,), NaN where a rollout gave None; where the
    request has components, a rollout's NaN reward is one it did not give (their sum then).
    """

    group_ids: list[str]
    group_sizes: np.ndarray  # int64 (G,)
    offsets: np.ndarray  # int64 (B+1,)
    tokens: np.ndarray  # integers (N,)
    rewards: np.ndarray  # float64 (B,)
    logprobs: np.ndarray | None = None  # numbers (N,)
    teacher_logprobs: dict[str, np.ndarray] = field(default_factory=dict)  # numbers (N,)
    entropy: np.ndarray | None = None  # numbers (N,)
    sum_pi_squared: np.ndarray | None = None  # numbers (N,)
    is_weights: np.ndarray | None = None  # numbers (N,)
    returns: np.ndarray | None = None  # numbers (N,)
    # Per group: its ``prompt_key`` (None where the group gave none); None when none did.
    prompt_keys: list[str | None] | None = None

    def prompt_ids(self) -> list[str] | None:
        """Per group, the key of its history: its prompt key, else its id (None when no
        group gave a key: the service keys history by the group ids then)."""
        return prompt_ids(self.group_ids, self.prompt_keys)

    planning_mask: np.ndarray | None = None  # numbers (N,), 0 or 1
    reward_components: dict[str, np.ndarray] = field(default_factory=dict)  # float64 (B,)

    def token_values(self) -> dict[str, np.ndarray]:
        """The per-token values of :data:`TOKEN_FIELDS` the rollouts gave (name -> (N,)), in
        that order."""
        out = {}
        for name in TOKEN_FIELDS:
            values = getattr(self, name)
            if values is not None:
                out[name] = values
        return out

    @property
    def group_index(self) -> np.ndarray:
        """int64 (B,): each rollout's group."""
        return np.repeat(np.arange(len(self.group_ids), dtype=np.int64), self.group_sizes)

    def for_wire(self) -> FlatGroups:
        """The same groups in the dtypes the wires carry: tokens int32 (int64 when an id does
        not fit), per-token values float32."""
        narrowed: dict[str, Any] = {
            name: values.astype(np.float32, copy=False)
            for name, values in self.token_values().items()
        }
        return replace(
            self,
            tokens=narrow_tokens(self.tokens),
            **narrowed,
            teacher_logprobs={
                name: values.astype(np.float32, copy=False)
                for name, values in self.teacher_logprobs.items()
            },
            reward_components={
                name: values.astype(np.float32, copy=False)
                for name, values in self.reward_components.items()
            },
        )


def prompt_ids(group_ids: Sequence[str], keys: Sequence[str | None] | None) -> list[str] | None:
    """Per group, its prompt key where it has one, else its group id; None without keys."""
    if keys is None or all(k is None for k in keys):
        return None
    return [gid if key is None else key for gid, key in zip(group_ids, keys, strict=True)]


def check_prompt_key(key: Any, **where: Any) -> str:
    """A group's ``prompt_key``: a string of at most :data:`MAX_GROUP_ID_LENGTH` characters."""
    if not isinstance(key, str):
        raise _error(
            "invalid_type",
            f"prompt_key must be a string, got {key!r:.80}",
            field="prompt_key",
            **where,
        )
    if len(key) > MAX_GROUP_ID_LENGTH:
        raise _too_long("prompt_key", len(key), MAX_GROUP_ID_LENGTH, "prompt_key", **where)
    return key


def group_prompt_keys(
    row_keys: Sequence[str | None] | np.ndarray, group_ids: Sequence[str], group_index: np.ndarray
) -> list[str | None]:
    """Per-row prompt keys (None: no key for that row) as one key per group. Every row of a
    group must give the same key (or every row none); the first group whose rows disagree is an
    error naming it. (One comparison over the rows; the per-group checks loop over groups.)"""
    keys = np.empty(len(row_keys), dtype=object)
    keys[:] = list(row_keys)
    index = np.asarray(group_index, dtype=np.int64)
    _, first = np.unique(index, return_index=True)
    per_group = np.empty(len(group_ids), dtype=object)
    per_group[index[first]] = keys[first]
    differ = np.flatnonzero(per_group[index] != keys)
    if differ.size:
        row = int(differ[0])
        g = int(index[row])
        raise _error(
            "invalid_value",
            f"the rows of group {group_ids[g]!r:.80} give different prompt keys "
            f"({per_group[g]!r:.80} and {keys[row]!r:.80}); every row of a group must give the "
            "same prompt_key",
            group_id=group_ids[g],
            field="prompt_key",
        )
    out: list[str | None] = per_group.tolist()
    for gid, key in zip(group_ids, out, strict=True):
        if key is not None:
            check_prompt_key(key, group_id=gid)
    return out


def _too_long(what: str, length: int, limit: int, field: str, **where: Any) -> AdvantageError:
    return _error(
        "limit_exceeded",
        f"{what} has {length} characters; the limit is {limit}",
        field=field,
        **where,
    )


def _error(code: str, message: str, **where: Any) -> AdvantageError:
    return AdvantageError(code, message, **where)


def token_array(values: Any, **where: Any) -> np.ndarray:
    """A rollout's token ids as a one-dimensional integer array."""
    array = to_numpy(values, "tokens") if is_array(values) else np.asarray(values)
    if array.size == 0:
        return np.zeros(0, dtype=np.int32)
    if array.ndim != 1:
        raise _error(
            "invalid_shape", f"tokens must be one-dimensional, got shape {array.shape}", **where
        )
    if array.dtype.kind not in "iu":
        raise _error("invalid_type", f"tokens must be integers, got {array.dtype}", **where)
    return array


def narrow_tokens(tokens: np.ndarray) -> np.ndarray:
    """int32 when every id fits (what tokenizers store), else int64."""
    if tokens.size == 0 or (int(tokens.min()) >= INT32_MIN and int(tokens.max()) <= INT32_MAX):
        return tokens.astype(np.int32, copy=False)
    return tokens.astype(np.int64, copy=False)


def _sequence(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


def _per_rollout(value: Any) -> list[Any] | np.ndarray | None:
    """A rollout's list of values as given (JSON lists stay lists: they are converted all at
    once), an array as an ndarray; None for anything that is neither."""
    if isinstance(value, list):
        return value
    if isinstance(value, np.ndarray):
        return widen(value)  # (ml_dtypes' bfloat16: numpy does not compute with it)
    if isinstance(value, tuple):
        return list(value)
    if is_array(value):  # torch, jax, pyarrow arrays
        try:
            return to_numpy(value)
        except AdvantageError:
            return None
    return None


def _as_array(values: list[Any]) -> np.ndarray | None:
    try:
        return np.array(values)
    except ValueError:  # ragged nesting: named by the element check
        return None


def _check_token_range(pieces: list[list[Any] | np.ndarray], name: str, where: Any) -> None:
    """Integers past int64 (numpy made them uint64): the first one's error, its true value."""
    for r, piece in enumerate(pieces):
        for t, x in enumerate(piece):
            if is_integer(x) and not -(2**63) <= int(x) < TOKEN_ID_LIMIT:
                raise _error(
                    "token_out_of_range",
                    f"token id {int(x)} at token {t} is not in [0, {TOKEN_ID_LIMIT})",
                    field=name,
                    **where(r),
                )


def _has_booleans(values: list[Any]) -> bool:
    """True when a list of numbers holds a boolean (one pass over the element types)."""
    types = set(map(type, values))
    return bool in types or np.bool_ in types


def _flat_values(
    pieces: list[list[Any] | np.ndarray], integer: bool, name: str, where: Any
) -> np.ndarray:
    """The rollouts' values concatenated into one array, naming the first bad element.

    From lists (converted by numpy in one pass): int64 (``integer``) or float64. From arrays
    (any rollout's values given as one): their concatenation, in numpy's promotion of their
    dtypes.
    """
    kinds = "iu" if integer else "iuf"
    default = np.dtype(np.int64 if integer else np.float64)
    if all(isinstance(p, list) for p in pieces):
        flat = list(chain.from_iterable(pieces))
        values = _as_array(flat)
        if integer and values is not None and values.dtype.kind == "u":
            _check_token_range(pieces, name, where)
        # (numpy reads true as 1: a boolean among the numbers is the client's mistake)
        if (
            values is not None
            and (values.size == 0 or values.dtype.kind in kinds)
            and not _has_booleans(flat)
        ):
            return values.astype(default, copy=False)
    else:
        arrays = []
        for p in pieces:
            a = p if isinstance(p, np.ndarray) else _as_array(p)
            if a is None or (a.size and (a.dtype.kind not in kinds or a.ndim != 1)):
                break
            if not isinstance(p, np.ndarray) and _has_booleans(p):
                break
            if a.size:
                arrays.append(a)
        else:
            if not arrays:
                return np.zeros(0, default)
            values = np.concatenate(arrays)
            # (uint64 with int64 promotes to float64)
            return values if values.dtype.kind in kinds else values.astype(default)
    # Error path only: find the first element of the wrong type.
    kind = "an integer" if integer else "a number"
    for r, piece in enumerate(pieces):
        if isinstance(piece, np.ndarray):
            if piece.size == 0 or (piece.dtype.kind in kinds and piece.ndim == 1):
                continue
            piece = piece.tolist()
        for t, x in enumerate(piece):
            if not (is_integer(x) if integer else is_number(x)):
                raise _error(
                    "invalid_type", f"{name}[{t}] must be {kind}, got {x!r}", field=name, **where(r)
                )
    if integer:  # every element an integer: one beyond int64
        _check_token_range(pieces, name, where)
    raise _error("invalid_type", f"{name} must hold numbers", field=name)


def flatten_groups(groups: Any) -> FlatGroups:
    """The request's ``groups`` (``[{"id", "prompt_key"?, "rollouts": [{"tokens", "reward",
    "logprobs"?, "entropy"?, "sum_pi_squared"?, "is_weights"?, "returns"?, "planning_mask"?,
    "teacher_logprobs"?}]}]``, lists or numpy arrays inside) as validated flat arrays.

    Checks what the layout needs (types, list lengths, values given for every rollout or none)
    and raises :class:`AdvantageError` naming the group id, rollout index and field of the first
    problem; what the values must satisfy beyond that (ids in range, finite values, distinct
    group ids) is the batch's business. One pass over the rollouts gathers list lengths; each
    flat array is then converted by numpy at once.
    """
    if not _sequence(groups):
        raise _error("invalid_type", "groups must be a list of groups", field="groups")
    rollouts: list[Mapping[str, Any]] = []
    sizes = []
    for g, group in enumerate(groups):
        if not isinstance(group, Mapping):
            raise _error("invalid_type", f"groups[{g}] must be an object", field="groups")
        gid = group.get("id")
        if not isinstance(gid, str):
            raise _error(
                "invalid_type", f"groups[{g}].id must be a string, got {gid!r:.80}", field="id"
            )
        if len(gid) > MAX_GROUP_ID_LENGTH:  # (not echoed: it is too long to be an id)
            raise _too_long(f"groups[{g}].id", len(gid), MAX_GROUP_ID_LENGTH, "id")
        if not gid:  # (as on gRPC streams, which key groups by id: every transport alike)
            raise _error("invalid_value", f"groups[{g}].id must be a non-empty string", field="id")
        extra = set(group) - {"id", "prompt_key", "rollouts"}
        if extra:
            raise _error(
                "unknown_field",
                f"group has unknown fields {sorted(map(str, extra))!r:.120}",
                group_id=gid,
                field=sorted(map(str, extra))[0],
            )
        members = group.get("rollouts")
        if not _sequence(members) or not members:
            raise _error(
                "invalid_type", "rollouts must be a non-empty list", group_id=gid, field="rollouts"
            )
        for i, r in enumerate(members):
            if not isinstance(r, Mapping):
                raise _error(
                    "invalid_type",
                    "a rollout must be an object",
                    group_id=gid,
                    rollout_index=i,
                    field="rollouts",
                )
        rollouts.extend(members)
        sizes.append(len(members))
    starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])[:-1]

    def where(r: int) -> dict[str, Any]:
        """group_id and rollout_index of flat rollout ``r`` (error paths only)."""
        g = int(np.searchsorted(starts, r, side="right")) - 1
        return {"group_id": str(groups[g].get("id")), "rollout_index": int(r - starts[g])}

    keys = [group.get("prompt_key") for group in groups]
    for group, key in zip(groups, keys, strict=True):
        if key is not None:
            check_prompt_key(key, group_id=group["id"])

    token_lists: list[list[Any] | np.ndarray] = []
    rewards = []
    # Per rollout, its components (name -> value, None kept) from the first that gave any.
    component_rows: list[dict[str, Any]] = []
    component_names: dict[str, None] = {}  # (in the order first given)
    teacher_names: set[str] = set()
    given: set[str] = set()  # the TOKEN_FIELDS some rollout gives
    for r, rollout in enumerate(rollouts):
        extra = set(rollout) - set(ROLLOUT_FIELDS)
        if extra:
            names = sorted(map(str, extra))
            raise _error(
                "unknown_field",
                f"rollout has unknown fields {names!r:.120}; known: {list(ROLLOUT_FIELDS)}",
                field=names[0],
                **where(r),
            )
        tokens = rollout.get("tokens")
        if not isinstance(tokens, list):
            tokens = _per_rollout(tokens)
        if tokens is None:
            raise _error(
                "invalid_type", "tokens must be a list of token ids", field="tokens", **where(r)
            )
        components = rollout.get(REWARD_COMPONENTS_FIELD)
        if components is not None:
            component_rows.append(rollout_components(components, component_names, r, where))
        elif component_rows:
            component_rows.append({})
        reward = to_number(rollout.get("reward"))  # (a 0-d array of any framework too)
        if reward is None and components is not None:
            reward = math.nan  # (their sum: the service's, with the estimator's weights)
        else:
            check_reward(reward, "reward", where(r))
        if isinstance(tokens, np.ndarray) and tokens.ndim != 1:
            raise _error(
                "invalid_shape",
                f"tokens must be one-dimensional, got shape {tokens.shape}",
                field="tokens",
                **where(r),
            )
        token_lists.append(tokens)
        rewards.append(reward)
        for name in TOKEN_FIELDS:
            if name not in given and rollout.get(name) is not None:
                given.add(name)
        teacher = rollout.get("teacher_logprobs")
        if teacher is not None:
            if not isinstance(teacher, Mapping):
                raise _error(
                    "invalid_type",
                    "teacher_logprobs must map condition names to lists",
                    field="teacher_logprobs",
                    **where(r),
                )
            for name in teacher:
                if isinstance(name, str) and len(name) > MAX_CONDITION_NAME_LENGTH:
                    raise _too_long(
                        "a teacher_logprobs condition name",
                        len(name),
                        MAX_CONDITION_NAME_LENGTH,
                        "teacher_logprobs",
                        **where(r),
                    )
            teacher_names.update(teacher)
            if len(teacher_names) > MAX_TEACHER_CONDITIONS:
                raise _error(
                    "limit_exceeded",
                    f"the request has more than {MAX_TEACHER_CONDITIONS} teacher_logprobs "
                    "conditions",
                    field="teacher_logprobs",
                    **where(r),
                )

    # (1-D arrays: len is their size)
    lengths = [len(t) for t in token_lists]

    def per_token(get: Any, name: str) -> np.ndarray:
        pieces = []
        for r, rollout in enumerate(rollouts):
            values = get(rollout)
            if values is None:
                raise _error(
                    "missing_input",
                    f"{name} is given for some rollouts but not this one; give "
                    "it for every rollout or none",
                    field=name,
                    **where(r),
                )
            if not isinstance(values, list):
                values = _per_rollout(values)
                if values is None:
                    raise _error(
                        "invalid_type", f"{name} must be a list of numbers", field=name, **where(r)
                    )
                if isinstance(values, np.ndarray) and values.ndim != 1:
                    raise _error(
                        "invalid_shape",
                        f"{name} must be one-dimensional, got shape {values.shape}",
                        field=name,
                        **where(r),
                    )
            if len(values) != lengths[r]:
                raise _error(
                    "length_mismatch",
                    f"{name} has {len(values)} values for {lengths[r]} tokens",
                    field=name,
                    **where(r),
                )
            pieces.append(values)
        return _flat_values(pieces, False, name, where)

    token_values: dict[str, Any] = {
        name: per_token(lambda r, n=name: r.get(n), name) for name in TOKEN_FIELDS if name in given
    }
    teacher_logprobs = {
        name: per_token(
            lambda r, n=name: (r.get("teacher_logprobs") or {}).get(n), f"teacher_logprobs.{name}"
        )
        for name in sorted(teacher_names)
    }
    flat_tokens = _flat_values(token_lists, True, "tokens", where)
    reward_components = component_arrays(component_rows, component_names, len(rollouts), where)
    # Nested lists convert to more than one dimension.
    for name, values in (
        ("tokens", flat_tokens),
        *token_values.items(),
        *((f"teacher_logprobs.{k}", v) for k, v in teacher_logprobs.items()),
    ):
        if values is not None and values.ndim != 1:
            raise _error(
                "invalid_shape",
                f"{name} must be one-dimensional, got shape {values.shape}",
                field=name,
            )
    return FlatGroups(
        group_ids=[g["id"] for g in groups],
        group_sizes=np.asarray(sizes, dtype=np.int64),
        offsets=np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64),
        tokens=flat_tokens,
        rewards=np.asarray(rewards, dtype=np.float64),
        teacher_logprobs=teacher_logprobs,
        prompt_keys=keys if any(k is not None for k in keys) else None,
        reward_components=reward_components,
        **token_values,
    )


def check_top_level(request: Any) -> None:
    if not isinstance(request, Mapping):
        raise _error("invalid_type", "the request must be a JSON object (a dict)")
    for key in request:
        if key not in TOP_LEVEL_FIELDS:
            raise _error(
                "unknown_field",
                f"unknown request field {key!r}; known: {list(TOP_LEVEL_FIELDS)}",
                field=str(key),
            )


def split_rows(values: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    """Views of ``values`` (N,) per rollout by ``offsets`` (B+1,)."""
    return np.split(values, offsets[1:-1]) if offsets.size > 1 else []


def nest_rows(
    group_ids: Sequence[str],
    group_index: np.ndarray,
    rows: Sequence[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Per-rollout dicts (request order) as ``[{"id", "rollouts": [...]}]`` in group order,
    each group's rollouts in request order."""
    order = np.argsort(group_index, kind="stable")
    sizes: Sequence[int] = (
        np.bincount(group_index, minlength=len(group_ids)).tolist() if len(group_index) else []
    )
    out = []
    start = 0
    for gid, size in zip(group_ids, sizes, strict=True):
        members = order[start : start + int(size)]
        out.append({"id": gid, "rollouts": [rows[int(i)] for i in members]})
        start += int(size)
    return out
