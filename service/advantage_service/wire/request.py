"""The JSON request contract (ARCHITECTURE.md, "Public HTTP API") decoded into a flat batch.

:func:`parse_options` checks the top-level fields; the rollouts become a batch by
:func:`batch_from_groups` (JSON ``groups``, gRPC stream groups: the client package's one builder,
``advantage_contract.flat.flatten_groups``, numpy only) or by a transport's own decoder (Arrow
tables, gRPC tensors), and :meth:`RequestOptions.with_batch` joins the two.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from advantage_contract.errors import AdvantageError
from advantage_contract.flat import TOP_LEVEL_FIELDS, flatten_groups

from ..batch import RolloutBatch
from ..batch.validation import component_weights
from ..errors import LimitExceeded, RequestError, shown
from ..estimators import EstimatorSpec, resolve_estimator
from ..estimators.pipeline import all_diagnostics
from .text import all_text, check_tree, invalid_text

DEFAULT_NAMESPACE = "default"

# What the request schema allows, the same on every transport (docs/http.md, "Limits"): the
# JSON decoder refuses more while it scans, gRPC before it builds the batch, and every
# transport's options pass parse_options. Ids are logged, kept as Redis keys and echoed back;
# names are the registry's (the longest preset, parameter or diagnostic name is 21 characters).
MAX_REQUEST_ID_LENGTH = 256
MAX_NAMESPACE_LENGTH = 128
# (Group ids, 256, teacher condition names, 64, and 64 distinct conditions in a request:
# advantage_contract.flat's MAX_GROUP_ID_LENGTH, MAX_CONDITION_NAME_LENGTH and
# MAX_TEACHER_CONDITIONS, which the client's builder checks too.)
MAX_NAME_LENGTH = 64  # estimator, preset, outcome, term and parameter names and string values
MAX_RETURN_NAMES = 64  # entries of `return` (there are fewer diagnostics than that)
MAX_IGNORE_TOKEN_IDS = 65_536
MAX_ESTIMATOR_JSON_BYTES = 16_384  # the estimator value as JSON text (gRPC's estimator_json)
MAX_ESTIMATOR_VALUES = 1_024  # values (names, numbers, objects) in an estimator object
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


@dataclass(frozen=True)
class RequestOptions:
    """A request's checked top-level fields: everything but its rollouts."""

    estimator: EstimatorSpec
    request_id: str
    namespace: str = DEFAULT_NAMESPACE
    ignore_token_ids: list[int] = field(default_factory=list)
    vocab_size: int | None = None
    returns: tuple[str, ...] = ()
    client_request_id: bool = False

    def with_batch(self, batch: RolloutBatch) -> ComputeRequest:
        """The request of these options over ``batch``: the rewards a rollout gave only as
        reward components summed with the estimator's ``weights`` (when its outcome has
        them)."""
        return ComputeRequest(
            batch=batch.with_component_weights(component_weights(self.estimator.outcome_params)),
            estimator=self.estimator,
            request_id=self.request_id,
            namespace=self.namespace,
            ignore_token_ids=list(self.ignore_token_ids),
            vocab_size=self.vocab_size,
            returns=self.returns,
            client_request_id=self.client_request_id,
        )


def with_server_defaults(
    req: ComputeRequest, ignore_token_ids: Sequence[int] = ()
) -> ComputeRequest:
    """``req`` with the server's defaults for what it did not give: ``ignore_token_ids``
    (``ADV_IGNORE_TOKEN_IDS``) when its own list is empty. (A request that wants none where the
    server sets some gives an id no token has, e.g. ``[-1]``.)"""
    if req.ignore_token_ids or not ignore_token_ids:
        return req
    return replace(req, ignore_token_ids=[int(t) for t in ignore_token_ids])


def parse_request(obj: Any) -> ComputeRequest:
    """Decode and validate a JSON request (already parsed into Python objects)."""
    options = parse_options(obj)
    return options.with_batch(batch_from_groups(obj.get("groups"), options.vocab_size))


def parse_options(obj: Any) -> RequestOptions:
    """Decode and validate every top-level field of a request but ``groups`` (left to the
    caller: :func:`batch_from_groups`, or a transport that carries the rollouts elsewhere)."""
    if not isinstance(obj, Mapping):
        raise RequestError("invalid_type", "the request must be a JSON object")
    # Every key and string value first (the few of the top level: ids, names, the estimator),
    # so that no check after this, nor its error, meets a string that is not text.
    # (ignore_token_ids is integers or refused without being repeated; groups are checked by
    # batch_from_groups or the transport that carries the rollouts.)
    check_tree(obj, skip=("groups", "ignore_token_ids"))
    for key in obj:
        if key not in TOP_LEVEL_FIELDS:
            raise RequestError(
                "unknown_field",
                f"unknown request field {shown(key)}; known: {list(TOP_LEVEL_FIELDS)}",
                field=str(key),
            )
    request_id = obj.get("request_id")
    if request_id is not None and not isinstance(request_id, str):
        raise RequestError("invalid_type", "request_id must be a string", field="request_id")
    if request_id is not None and len(request_id) > MAX_REQUEST_ID_LENGTH:
        # (it is logged and kept as a Redis key for the TTL: a request id, not a payload)
        raise LimitExceeded(
            f"request_id has {len(request_id)} characters; the limit is {MAX_REQUEST_ID_LENGTH}",
            field="request_id",
        )
    namespace = obj.get("namespace", DEFAULT_NAMESPACE)
    if not isinstance(namespace, str) or not namespace or len(namespace) > MAX_NAMESPACE_LENGTH:
        raise RequestError(
            "invalid_type",
            f"namespace must be a non-empty string of at most {MAX_NAMESPACE_LENGTH} characters",
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
    if isinstance(ignore, list) and len(ignore) > MAX_IGNORE_TOKEN_IDS:
        raise LimitExceeded(
            f"ignore_token_ids has {len(ignore)} ids; the limit is {MAX_IGNORE_TOKEN_IDS}",
            field="ignore_token_ids",
        )
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
    check_names(returns)
    check_estimator(obj.get("estimator"))
    estimator = resolve_estimator(obj.get("estimator"))
    return RequestOptions(
        estimator=estimator,
        request_id=request_id or uuid.uuid4().hex,
        namespace=namespace,
        ignore_token_ids=list(ignore),
        vocab_size=vocab_size,
        returns=tuple(dict.fromkeys(returns)),
        client_request_id=request_id is not None,
    )


def check_names(returns: Sequence[str]) -> None:
    """``return``: at most :data:`MAX_RETURN_NAMES` names of at most :data:`MAX_NAME_LENGTH`
    characters (422 ``invalid_parameter``, as an unknown name is; the name not echoed)."""
    if len(returns) > MAX_RETURN_NAMES:
        raise RequestError(
            "invalid_parameter",
            f"return lists {len(returns)} names; at most {MAX_RETURN_NAMES} may be asked for",
            field="return",
        )
    for name in returns:
        if len(name) > MAX_NAME_LENGTH:
            raise RequestError(
                "invalid_parameter",
                f"return has a name of {len(name)} characters; names are at most {MAX_NAME_LENGTH}",
                field="return",
            )


def check_estimator(value: Any) -> None:
    """An estimator value of the request's size: every name and string value at most
    :data:`MAX_NAME_LENGTH` characters, at most :data:`MAX_ESTIMATOR_VALUES` values in all
    (422, as any name the registry lacks is, on ``estimator``; nothing echoed). What the
    values mean is ``resolve_estimator``'s to check; this keeps what it echoes short."""
    stack = [value]
    seen = 0
    while stack:
        node = stack.pop()
        seen += 1
        if seen > MAX_ESTIMATOR_VALUES:
            raise RequestError(
                "invalid_parameter",
                f"the estimator holds more than {MAX_ESTIMATOR_VALUES} values; an estimator "
                "object has a few dozen",
                field="estimator",
            )
        if isinstance(node, str) and len(node) > MAX_NAME_LENGTH:
            raise RequestError(
                "unknown_estimator" if node is value else "invalid_parameter",
                f"the estimator has a name or value of {len(node)} characters; names and "
                f"values are at most {MAX_NAME_LENGTH}",
                field="estimator",
            )
        if isinstance(node, Mapping):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)


def batch_from_groups(groups: Any, vocab_size: int | None) -> RolloutBatch:
    """The ``groups`` array (rollout dicts: JSON lists, or numpy arrays from a gRPC stream) as a
    validated flat batch; errors name the group, rollout and field."""
    try:
        flat = flatten_groups(groups)
    except AdvantageError as exc:
        # The builder's errors repeat the group id and an unknown field's name: a string that
        # is not text is what is named, first (a walk of the groups, on this error path only).
        check_tree(groups, "groups")
        raise RequestError.from_contract(exc) from exc
    # The strings the batch keeps (ids, prompt keys, teacher condition names: echoed in the
    # answer, logged, kept as keys): one join where they are all text; the walk that names
    # the culprit only where one is not. (Every other string of the groups is one the builder
    # refuses, above.)
    kept = [
        *flat.group_ids,
        *flat.teacher_logprobs,
        *flat.reward_components,
        *(k for k in flat.prompt_keys or () if k),
    ]
    if not all_text(kept):
        check_tree(groups, "groups")
        raise invalid_text("groups")
    return RolloutBatch.from_flat(
        tokens=flat.tokens,
        offsets=flat.offsets,
        group_ids=flat.group_ids,
        group_index=flat.group_index,
        rewards=flat.rewards,
        teacher_logprobs=flat.teacher_logprobs,
        vocab_size=vocab_size,
        prompt_ids=flat.prompt_ids(),
        reward_components=flat.reward_components,
        **flat.token_values(),
    )
