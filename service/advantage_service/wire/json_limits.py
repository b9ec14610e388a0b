"""What a JSON request body may hold before it is decoded, and what it is told when it holds
more: the bounds wire/json_guard.py's pass checks (besides the request schema's own, from
wire/request.py and advantage_contract), and its refusals.

The words are those parse_options, the engine and gRPC use for the same bound, so that a
request is refused alike whatever carries it; each names the field (and the group and rollout
where the pass is in one: ``where``) and never repeats a string that is too long.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from advantage_contract.fields import (
    MAX_COMPONENT_NAME_LENGTH,
    MAX_REWARD_COMPONENTS,
    REWARD_COMPONENTS_FIELD,
)
from advantage_contract.flat import (
    MAX_CONDITION_NAME_LENGTH,
    MAX_TEACHER_CONDITIONS,
    TOP_LEVEL_FIELDS,
)

from ..errors import SPLIT_HINT, LimitExceeded, RequestError, shown
from .request import (
    MAX_ESTIMATOR_JSON_BYTES,
    MAX_IGNORE_TOKEN_IDS,
    MAX_NAME_LENGTH,
    MAX_NAMESPACE_LENGTH,
    MAX_RETURN_NAMES,
)

# The deepest a request nests (its estimator object: 4) is far from this.
MAX_DEPTH = 64
# Keys an object of the request may have: the known fields and a few unknown ones (named by the
# error that refuses them), so that a key given again and again is refused.
MAX_FIELDS = 16
# JSON where the schema has none (an object for a reward, a list of lists for tokens, an
# unknown group field's value): decoded for the error that names it, up to this much in all.
MAX_UNEXPECTED_BYTES = 1 << 20


@dataclass(frozen=True)
class BodyLimits:
    """What a request body may hold, checked before it is decoded (the service's settings)."""

    max_tokens: int
    max_rollouts: int


# group_id (None before the group's id is met) and, inside a rollout, rollout_index.
Where = dict[str, Any]


def not_json(what: str) -> RequestError:
    return RequestError("invalid_json", f"request body is not valid JSON: {what}")


def too_deep() -> RequestError:
    return RequestError("invalid_json", "the JSON is nested too deeply to be a request")


def unknown_field(key: str) -> RequestError:
    """A top-level field the request does not have (parse_options' words, before its value is
    read)."""
    return RequestError(
        "unknown_field",
        f"unknown request field {shown(key)}; known: {list(TOP_LEVEL_FIELDS)}",
        field=key,
    )


def too_many_fields(what: str, key: str, limit: int, where: Where) -> RequestError:
    return RequestError(
        "invalid_json",
        f"{what} has more than {limit} fields (a field given more than once?)",
        field=key,
        **where,
    )


def too_many_conditions(where: Where) -> LimitExceeded:
    return LimitExceeded(
        f"the request has more than {MAX_TEACHER_CONDITIONS} teacher_logprobs conditions",
        field="teacher_logprobs",
        **where,
    )


def too_many_components(where: Where) -> LimitExceeded:
    return LimitExceeded(
        f"the request has more than {MAX_REWARD_COMPONENTS} reward components",
        field=REWARD_COMPONENTS_FIELD,
        **where,
    )


def too_many_groups(limit: int) -> LimitExceeded:
    return LimitExceeded(
        f"the request has more than {limit} groups, and a group has at least one rollout; the "
        f"limit is {limit} rollouts (ADV_MAX_REQUEST_ROLLOUTS): {SPLIT_HINT}",
        field="groups",
    )


def too_many_return_names() -> RequestError:
    return RequestError(  # (parse_options' answer: a 422, as for an unknown name)
        "invalid_parameter",
        f"return lists more than {MAX_RETURN_NAMES} names; at most {MAX_RETURN_NAMES} may be "
        "asked for",
        field="return",
    )


def too_many_ignored(count: int) -> LimitExceeded:
    return LimitExceeded(
        f"ignore_token_ids has {count} ids; the limit is {MAX_IGNORE_TOKEN_IDS}",
        field="ignore_token_ids",
    )


def estimator_too_large() -> RequestError:
    return RequestError(  # (an estimator the registry cannot have: a 422, as gRPC's)
        "invalid_parameter",
        f"the estimator is more than {MAX_ESTIMATOR_JSON_BYTES} bytes of JSON; an estimator "
        "object is a few hundred",
        field="estimator",
    )


def over_counts(
    rollouts: int, tokens: int, values: dict[str, int], max_rollouts: int, max_tokens: int
) -> LimitExceeded:
    """A request over the rollout or token limit (or with more values of a per-token field than
    that: one value per token), with its counts (the engine's words, as gRPC gives them)."""
    if rollouts > max_rollouts:
        return LimitExceeded(
            f"the request has {rollouts} rollouts; the limit is {max_rollouts} "
            f"(ADV_MAX_REQUEST_ROLLOUTS): {SPLIT_HINT}",
            field="rollouts",
        )
    if tokens > max_tokens:
        return LimitExceeded(
            f"the request has {tokens} tokens; the limit is {max_tokens} "
            f"(ADV_MAX_REQUEST_TOKENS): {SPLIT_HINT}",
            field="tokens",
        )
    name, count = max(values.items(), key=lambda item: item[1])
    return LimitExceeded(
        f"the request has {count} {name} values, one per token; the token limit is "
        f"{max_tokens} (ADV_MAX_REQUEST_TOKENS)",
        field=name,
    )


def unexpected_json(
    field: str | None, known: tuple[str, ...], limit: int, where: Where
) -> RequestError:
    """More than ``limit`` bytes of JSON where the schema has none: an unknown field's value,
    or a value of a type its field does not take."""
    if field is not None and known and field not in known:
        return RequestError(
            "unknown_field",
            f"unknown field {shown(field)} with more than {limit} bytes of JSON; known: "
            f"{list(known)}",
            field=field,
            **where,
        )
    return RequestError(
        "invalid_type",
        f"{field or 'the request'} holds more than {limit} bytes of JSON of a type it does not "
        "take",
        field=field,
        **where,
    )


def long_key(place: str, field: str | None, chars: str, where: Where) -> RequestError:
    """A key of ``chars`` (longer than any name the request has) in ``place``: a teacher
    condition (``teacher_logprobs``), the ``request``'s top level, the ``estimator``, a
    ``group`` or ``rollout`` (no field of theirs is that long), else the value of ``field``."""
    if place == "teacher_logprobs":
        return LimitExceeded(
            f"a teacher_logprobs condition name has {chars}; the limit is "
            f"{MAX_CONDITION_NAME_LENGTH}",
            field="teacher_logprobs",
            **where,
        )
    if place == REWARD_COMPONENTS_FIELD:
        return LimitExceeded(
            f"a reward component name has {chars}; the limit is {MAX_COMPONENT_NAME_LENGTH}",
            field=REWARD_COMPONENTS_FIELD,
            **where,
        )
    if place == "request":
        return RequestError(
            "unknown_field",
            f"unknown request field of {chars}; known: {list(TOP_LEVEL_FIELDS)}",
            field="request",
        )
    if place == "estimator":
        return RequestError(
            "invalid_parameter",
            f"the estimator has a name of {chars}; names are at most {MAX_NAME_LENGTH}",
            field="estimator",
        )
    if place in ("group", "rollout"):
        return RequestError(
            "unknown_field", f"a {place} has an unknown field of {chars}", field=field, **where
        )
    return LimitExceeded(
        f"{field or 'the request'} has a field name of {chars}; no field name is longer than "
        f"{MAX_NAME_LENGTH}",
        field=field,
        **where,
    )


def long_value(
    place: str, field: str | None, chars: str, limit: int, where: Where, group: int
) -> RequestError:
    """A string of ``chars`` (over ``limit``) as the ``namespace``, a group's ``id`` (the
    ``group``-th), the ``request_id``, the estimator's ``preset`` or a ``name`` (of the estimator
    or ``return``), else as ``field``'s value."""
    if place == "namespace":
        return RequestError(  # (parse_options' answer to the same)
            "invalid_type",
            f"namespace must be a non-empty string of at most {MAX_NAMESPACE_LENGTH} characters",
            field="namespace",
        )
    if place == "id":
        return LimitExceeded(f"groups[{group}].id has {chars}; the limit is {limit}", field="id")
    if place == "request_id":
        return LimitExceeded(f"request_id has {chars}; the limit is {limit}", field="request_id")
    if place in ("preset", "name"):  # (a 422, as for any name the registry lacks)
        return RequestError(
            "unknown_estimator" if place == "preset" else "invalid_parameter",
            f"{field} has a {'preset' if place == 'preset' else 'name or value'} of {chars}; "
            f"names are at most {limit}",
            field=field,
        )
    return LimitExceeded(
        f"{field or 'the request'} has a string of {chars}; the limit is {limit}",
        field=field,
        **where,
    )
