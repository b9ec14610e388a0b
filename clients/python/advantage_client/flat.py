"""The JSON request's ``groups`` as flat arrays (the service's batch layout), and back.

Flat layout: all rollouts' tokens concatenated (N,), ``offsets`` (B+1,) with rollout i owning
``tokens[offsets[i]:offsets[i + 1]]``, ``group_index`` (B,) into ``group_ids``. Both binary
wires (gRPC tensors, Arrow list columns) carry exactly these arrays.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import numpy as np

from .errors import AdvantageError

TOP_LEVEL_FIELDS = (
    "request_id",
    "namespace",
    "estimator",
    "ignore_token_ids",
    "vocab_size",
    "return",
    "groups",
)
ROLLOUT_FIELDS = ("tokens", "reward", "logprobs", "teacher_logprobs")
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


@dataclass
class FlatGroups:
    """Groups of rollouts as flat numpy arrays (rollouts in group order)."""

    group_ids: list[str]
    group_sizes: np.ndarray  # int64 (G,)
    offsets: np.ndarray  # int64 (B+1,)
    tokens: np.ndarray  # int32 (N,); int64 when an id does not fit
    rewards: np.ndarray  # float64 (B,)
    logprobs: np.ndarray | None = None  # float32 (N,)
    teacher_logprobs: dict[str, np.ndarray] = field(default_factory=dict)  # float32 (N,)

    @property
    def group_index(self) -> np.ndarray:
        """int64 (B,): each rollout's group."""
        return np.repeat(np.arange(len(self.group_ids), dtype=np.int64), self.group_sizes)


def _error(code: str, message: str, **where: Any) -> AdvantageError:
    return AdvantageError(code, message, **where)


def is_number(x: Any) -> TypeGuard[float]:
    return isinstance(x, numbers.Real) and not isinstance(x, bool | np.bool_)


def token_array(values: Any, **where: Any) -> np.ndarray:
    """A rollout's token ids as a one-dimensional integer array."""
    array = np.asarray(values)
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


def float_array(values: Any, name: str, length: int, **where: Any) -> np.ndarray:
    try:
        array = np.asarray(values, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise _error(
            "invalid_type", f"{name} must be a list of numbers: {exc}", field=name, **where
        ) from exc
    if array.ndim != 1 or array.size != length:
        raise _error(
            "length_mismatch",
            f"{name} has {array.size} values for {length} tokens",
            field=name,
            **where,
        )
    return array


def flatten_groups(groups: Any) -> FlatGroups:
    """The request's ``groups`` (lists or numpy arrays inside) as flat arrays.

    Raises :class:`AdvantageError` for what the flat layout cannot express (a missing field,
    logprobs on some rollouts only); values it can carry are left for the service to judge.
    """
    if not isinstance(groups, Sequence) or isinstance(groups, str | bytes):
        raise _error("invalid_type", "groups must be a list of groups", field="groups")
    group_ids: list[str] = []
    sizes: list[int] = []
    tokens: list[np.ndarray] = []
    rewards: list[float] = []
    rollouts: list[tuple[Mapping[str, Any], dict[str, Any]]] = []
    for g, group in enumerate(groups):
        if not isinstance(group, Mapping):
            raise _error("invalid_type", f"groups[{g}] must be an object", field="groups")
        gid = group.get("id")
        if not isinstance(gid, str):
            raise _error(
                "invalid_type", f"groups[{g}].id must be a string, got {gid!r}", field="id"
            )
        extra = set(group) - {"id", "rollouts"}
        if extra:
            raise _error(
                "unknown_field",
                f"group has unknown fields {sorted(extra)}",
                group_id=gid,
                field=sorted(extra)[0],
            )
        members = group.get("rollouts")
        if not isinstance(members, Sequence) or isinstance(members, str) or not members:
            raise _error(
                "invalid_type", "rollouts must be a non-empty list", group_id=gid, field="rollouts"
            )
        group_ids.append(gid)
        sizes.append(len(members))
        for i, rollout in enumerate(members):
            where: dict[str, Any] = {"group_id": gid, "rollout_index": i}
            if not isinstance(rollout, Mapping):
                raise _error(
                    "invalid_type", "a rollout must be an object", field="rollouts", **where
                )
            extra = set(rollout) - set(ROLLOUT_FIELDS)
            if extra:
                raise _error(
                    "unknown_field",
                    f"rollout has unknown fields {sorted(extra)}; known: {list(ROLLOUT_FIELDS)}",
                    field=sorted(extra)[0],
                    **where,
                )
            if "tokens" not in rollout:
                raise _error("missing_input", "tokens is required", field="tokens", **where)
            reward = rollout.get("reward")
            if not is_number(reward):
                raise _error(
                    "invalid_type",
                    f"reward must be a number, got {reward!r}",
                    field="reward",
                    **where,
                )
            tokens.append(token_array(rollout["tokens"], field="tokens", **where))
            rewards.append(float(reward))
            rollouts.append((rollout, where))

    lengths = np.fromiter((t.size for t in tokens), dtype=np.int64, count=len(tokens))

    def per_token(get: Any, name: str) -> np.ndarray:
        arrays = []
        for (rollout, where), n in zip(rollouts, lengths, strict=True):
            values = get(rollout)
            if values is None:
                raise _error(
                    "missing_input",
                    f"{name} is given for some rollouts but not this one; give it for every "
                    "rollout or none",
                    field=name,
                    **where,
                )
            arrays.append(float_array(values, name, int(n), **where))
        return np.concatenate(arrays) if arrays else np.zeros(0, np.float32)

    logprobs = None
    if any(r.get("logprobs") is not None for r, _ in rollouts):
        logprobs = per_token(lambda r: r.get("logprobs"), "logprobs")
    conditions: set[str] = set()
    for rollout, where in rollouts:
        teacher = rollout.get("teacher_logprobs")
        if teacher is not None:
            if not isinstance(teacher, Mapping):
                raise _error(
                    "invalid_type",
                    "teacher_logprobs must map condition names to lists",
                    field="teacher_logprobs",
                    **where,
                )
            conditions.update(teacher)
    teacher_logprobs = {
        c: per_token(
            lambda r, c=c: (r.get("teacher_logprobs") or {}).get(c), f"teacher_logprobs.{c}"
        )
        for c in sorted(conditions)
    }
    all_tokens = np.concatenate(tokens) if tokens else np.zeros(0, np.int32)
    return FlatGroups(
        group_ids=group_ids,
        group_sizes=np.asarray(sizes, dtype=np.int64),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        tokens=narrow_tokens(all_tokens),
        rewards=np.asarray(rewards, dtype=np.float64),
        logprobs=logprobs,
        teacher_logprobs=teacher_logprobs,
    )


def check_top_level(request: Any) -> None:
    if not isinstance(request, Mapping):
        raise _error("invalid_type", "the request must be a JSON object (a dict)", field="")
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
