"""The JSON request contract (ARCHITECTURE.md, "Public HTTP API") decoded into a flat batch.

Decoding walks the rollouts once to gather list lengths (a Python loop over rollouts is the
price of nested JSON); the values themselves are converted by numpy in one pass per array.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from .batch import RolloutBatch
from .errors import RequestError
from .estimators import EstimatorSpec, resolve_estimator
from .estimators.pipeline import all_diagnostics

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
DEFAULT_NAMESPACE = "default"
# JSON integers are unbounded; numbers the batch arrays cannot hold are request errors.
INT64_LIMIT = 2**63


@dataclass
class ComputeRequest:
    """A decoded, validated request: the flat batch plus what to compute and return."""

    batch: RolloutBatch
    estimator: EstimatorSpec
    request_id: str
    namespace: str = DEFAULT_NAMESPACE
    ignore_token_ids: list[int] = field(default_factory=list)
    vocab_size: int | None = None
    returns: tuple[str, ...] = ()
    # True when the client sent request_id (idempotency applies only then).
    client_request_id: bool = False


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _where(groups: Sequence[Any], rollout: int, starts: np.ndarray) -> dict[str, Any]:
    group = int(np.searchsorted(starts, rollout, side="right")) - 1
    return {"group_id": str(groups[group].get("id")), "rollout_index": int(rollout - starts[group])}


def _flat_values(
    lists: list[Any], dtype: type, name: str, groups: Sequence[Any], starts: np.ndarray
) -> np.ndarray:
    """Concatenate per-rollout number lists into one array, naming the first bad element."""
    flat = list(chain.from_iterable(lists))
    values = np.array(flat)
    ok = (
        values.dtype.kind in ("i", "u")
        if dtype is np.int64
        else values.dtype.kind in ("i", "u", "f")
    )
    if ok or values.size == 0:
        return values.astype(dtype, copy=False)
    # Error path only: find the first element of the wrong type.
    for r, lst in enumerate(lists):
        for t, x in enumerate(lst):
            if not _is_number(x) or (dtype is np.int64 and not isinstance(x, int)):
                kind = "an integer" if dtype is np.int64 else "a number"
                raise RequestError(
                    "invalid_type",
                    f"{name}[{t}] must be {kind}, got {x!r}",
                    field=name,
                    **_where(groups, r, starts),
                )
    raise RequestError("invalid_type", f"{name} must hold numbers", field=name)


GroupsDecoder = Callable[[Any, int | None], RolloutBatch]


def parse_request(obj: Any, decode_groups: GroupsDecoder | None = None) -> ComputeRequest:
    """Decode and validate a JSON request (already parsed into Python objects).

    ``decode_groups(groups, vocab_size)`` builds the batch from the ``groups`` value (default:
    :func:`parse_groups`); a transport that carries the rollouts elsewhere (Arrow) passes its own.
    """
    if not isinstance(obj, Mapping):
        raise RequestError("invalid_type", "the request must be a JSON object", field="")
    for key in obj:
        if key not in TOP_LEVEL_FIELDS:
            raise RequestError(
                "unknown_field",
                f"unknown request field {key!r}; known: {list(TOP_LEVEL_FIELDS)}",
                field=str(key),
            )
    request_id = obj.get("request_id")
    if request_id is not None and not isinstance(request_id, str):
        raise RequestError("invalid_type", "request_id must be a string", field="request_id")
    namespace = obj.get("namespace", DEFAULT_NAMESPACE)
    if not isinstance(namespace, str) or not namespace or len(namespace) > 128:
        raise RequestError(
            "invalid_type",
            "namespace must be a non-empty string of at most 128 characters",
            field="namespace",
        )
    vocab_size = obj.get("vocab_size")
    if vocab_size is not None and (
        not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1
    ):
        raise RequestError(
            "invalid_type", "vocab_size must be a positive integer", field="vocab_size"
        )
    ignore = obj.get("ignore_token_ids") or []
    if not isinstance(ignore, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and abs(t) < INT64_LIMIT for t in ignore
    ):
        raise RequestError(
            "invalid_type",
            "ignore_token_ids must be a list of 64-bit integers",
            field="ignore_token_ids",
        )
    returns = obj.get("return") or []
    if not isinstance(returns, list) or not all(isinstance(r, str) for r in returns):
        raise RequestError(
            "invalid_type",
            f"return must be a list of names from {list(all_diagnostics())}",
            field="return",
        )
    estimator = resolve_estimator(obj.get("estimator"))
    batch = (decode_groups or parse_groups)(obj.get("groups"), vocab_size)
    return ComputeRequest(
        batch=batch,
        estimator=estimator,
        request_id=request_id or uuid.uuid4().hex,
        namespace=namespace,
        ignore_token_ids=list(ignore),
        vocab_size=vocab_size,
        returns=tuple(dict.fromkeys(returns)),
        client_request_id=request_id is not None,
    )


def parse_groups(groups: Any, vocab_size: int | None) -> RolloutBatch:
    """The ``groups`` array as a validated flat batch."""
    if not isinstance(groups, list):
        raise RequestError("invalid_type", "groups must be a list of groups", field="groups")
    rollouts: list[Mapping[str, Any]] = []
    sizes = []
    for g, group in enumerate(groups):
        if not isinstance(group, Mapping):
            raise RequestError("invalid_type", f"groups[{g}] must be an object", field="groups")
        gid = group.get("id")
        if not isinstance(gid, str):
            raise RequestError(
                "invalid_type", f"groups[{g}].id must be a string, got {gid!r}", field="id"
            )
        extra = set(group) - {"id", "rollouts"}
        if extra:
            raise RequestError(
                "unknown_field",
                f"group has unknown fields {sorted(extra)}",
                group_id=gid,
                field=sorted(extra)[0],
            )
        members = group.get("rollouts")
        if not isinstance(members, list) or not members:
            raise RequestError(
                "invalid_type", "rollouts must be a non-empty list", group_id=gid, field="rollouts"
            )
        for i, r in enumerate(members):
            if not isinstance(r, Mapping):
                raise RequestError(
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
        return _where(groups, r, starts)

    token_lists = []
    rewards = []
    teacher_names: set[str] = set()
    has_logprobs = 0
    for r, rollout in enumerate(rollouts):
        extra = set(rollout) - set(ROLLOUT_FIELDS)
        if extra:
            raise RequestError(
                "unknown_field",
                f"rollout has unknown fields {sorted(extra)}; known: {list(ROLLOUT_FIELDS)}",
                field=sorted(extra)[0],
                **where(r),
            )
        tokens = rollout.get("tokens")
        if not isinstance(tokens, list):
            raise RequestError(
                "invalid_type", "tokens must be a list of token ids", field="tokens", **where(r)
            )
        reward = rollout.get("reward")
        if not _is_number(reward):
            raise RequestError(
                "invalid_type",
                f"reward must be a number, got {reward!r}",
                field="reward",
                **where(r),
            )
        if isinstance(reward, int) and abs(reward) > sys.float_info.max:  # JSON allows it
            raise RequestError(
                "invalid_value",
                "reward is out of range; it must be finite",
                field="reward",
                **where(r),
            )
        token_lists.append(tokens)
        rewards.append(reward)
        has_logprobs += rollout.get("logprobs") is not None
        teacher = rollout.get("teacher_logprobs")
        if teacher is not None:
            if not isinstance(teacher, Mapping):
                raise RequestError(
                    "invalid_type",
                    "teacher_logprobs must map condition names to lists",
                    field="teacher_logprobs",
                    **where(r),
                )
            teacher_names.update(teacher)

    lengths = np.fromiter((len(t) for t in token_lists), dtype=np.int64, count=len(token_lists))

    def per_token(get: Any, name: str) -> np.ndarray:
        lists = []
        for r, rollout in enumerate(rollouts):
            values = get(rollout)
            if values is None:
                raise RequestError(
                    "missing_input",
                    f"{name} is given for some rollouts but not this one; give "
                    "it for every rollout or none",
                    field=name,
                    **where(r),
                )
            if not isinstance(values, list):
                raise RequestError(
                    "invalid_type", f"{name} must be a list of numbers", field=name, **where(r)
                )
            if len(values) != lengths[r]:
                raise RequestError(
                    "length_mismatch",
                    f"{name} has {len(values)} values for {lengths[r]} tokens",
                    field=name,
                    **where(r),
                )
            lists.append(values)
        return _flat_values(lists, np.float64, name, groups, starts)

    logprobs = per_token(lambda r: r.get("logprobs"), "logprobs") if has_logprobs else None
    teacher_logprobs = {
        name: per_token(
            lambda r, n=name: (r.get("teacher_logprobs") or {}).get(n), f"teacher_logprobs.{name}"
        )
        for name in sorted(teacher_names)
    }
    tokens = _flat_values(token_lists, np.int64, "tokens", groups, starts)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    group_index = np.repeat(np.arange(len(groups), dtype=np.int64), sizes)
    return RolloutBatch.from_flat(
        tokens=tokens,
        offsets=offsets,
        group_ids=[g["id"] for g in groups],
        group_index=group_index,
        rewards=np.asarray(rewards, dtype=np.float64),
        logprobs=logprobs,
        teacher_logprobs=teacher_logprobs,
        vocab_size=vocab_size,
    )
