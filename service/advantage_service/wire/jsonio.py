"""JSON text for the contract: numpy arrays become lists, and parse errors become RequestErrors.

One float formatting everywhere (HTTP, gRPC's JSON fields, Arrow metadata, the CLI): orjson's,
each float32 value in its shortest float32 repr (``0.70710576``, not ``0.7071057558059692``) and
float64 values in their shortest repr (``1e-6``).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from ..errors import LimitExceeded, RequestError


def _default(value: Any) -> Any:
    if isinstance(value, np.ndarray):  # (one orjson does not take natively: not contiguous)
        return np.ascontiguousarray(value)
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def dumps_bytes(obj: Any) -> bytes:
    """Compact JSON of a response (numpy arrays as lists), UTF-8."""
    return orjson.dumps(obj, default=_default, option=orjson.OPT_SERIALIZE_NUMPY)


def dumps(obj: Any) -> str:
    """Compact JSON of a response (numpy arrays as lists)."""
    return dumps_bytes(obj).decode()


def loads(text: str | bytes) -> Any:
    """Parse request JSON; malformed text raises RequestError (code ``invalid_json``)."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError("invalid_json", f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # (in gRPC's estimator_json, Arrow's metadata, ...)
        raise RequestError("invalid_json", "the JSON is nested too deeply to be a request") from exc
    except ValueError as exc:  # integers of more than 4300 digits
        raise RequestError("invalid_json", f"the JSON is not usable: {exc}") from exc


# ---- request bodies: bounded before the numbers are parsed ---------------------------------------

# A JSON string (matched whole, so that nothing inside one is taken for an array), or an array
# of numbers only: the per-token lists of a request. One pass of the regex engine over the body.
_STRING_OR_NUMBERS = re.compile(rb'("(?:[^"\\]|\\.)*")|(\[[-0-9.eE+,\s]*\])')
_INTEGERS_ONLY = re.compile(rb"[-0-9,\s]*")
# Integers of more digits than this might not fit int64: such an array takes the exact path.
_LONG_INTEGER = re.compile(rb"\d{19}")


@dataclass(frozen=True)
class BodyLimits:
    """What a request body may hold, checked before its numbers are parsed."""

    max_tokens: int
    max_rollouts: int


def loads_request(body: bytes, limits: BodyLimits | None = None) -> Any:
    """A request body parsed with its per-token arrays as numpy arrays, never as Python lists.

    ``json.loads`` of a body of number lists costs 8-40x the body in Python objects (a float is
    24 bytes, plus 8 for its list slot), and it cannot stop early. Here one regex pass replaces
    every array of numbers with a marker (strings are matched whole, so no array inside a string
    is touched), the small skeleton left is parsed by ``json``, the counts are checked against
    ``limits`` from the arrays' commas alone (a request over a limit is refused having held its
    body and the skeleton, nothing more), and only then is each array of a rollout parsed by
    numpy straight from the body's bytes (int64 when it holds integers only, else float64).
    Arrays elsewhere (``ignore_token_ids``) are json's lists, and so is an array numpy does not
    read exactly as ``json`` does (huge integers, odd forms) or token ids that are not all
    integers: the result is what ``json.loads`` gives but for the type of the rollouts' arrays
    (and, in their float arrays, 1 read as 1.0).
    """
    nonce = b"\\u0001" + secrets.token_hex(8).encode() + b":"
    spans: list[tuple[int, int]] = []

    def mark(match: re.Match[bytes]) -> bytes:
        if match.group(2) is None:
            return match.group(1)
        spans.append(match.span(2))
        return b'"%s%d"' % (nonce, len(spans) - 1)

    skeleton = loads(_STRING_OR_NUMBERS.sub(mark, body))
    marker = "\x01" + nonce[6:].decode()
    if limits is not None:
        _check_counts(skeleton, body, spans, marker, limits)
    return _resolve(skeleton, body, spans, marker)


def _marker_index(value: Any, marker: str) -> int | None:
    if isinstance(value, str) and value.startswith(marker):
        return int(value[len(marker) :])
    return None


def _rollouts(skeleton: Any) -> list[dict[str, Any]]:
    """The rollout objects of a well-formed skeleton (what is malformed the builder reports)."""
    out: list[dict[str, Any]] = []
    groups = skeleton.get("groups") if isinstance(skeleton, dict) else None
    for group in groups if isinstance(groups, list) else ():
        rollouts = group.get("rollouts") if isinstance(group, dict) else None
        out.extend(
            r for r in (rollouts if isinstance(rollouts, list) else ()) if isinstance(r, dict)
        )
    return out


def _count(body: bytes, span: tuple[int, int]) -> int:
    """The values of an array of numbers, from its commas (0 for an empty one)."""
    start, end = span
    if not body[start + 1 : end - 1].strip():
        return 0
    return body.count(b",", start, end) + 1


def _check_counts(
    skeleton: Any, body: bytes, spans: list[tuple[int, int]], marker: str, limits: BodyLimits
) -> None:
    rollouts = _rollouts(skeleton)
    if len(rollouts) > limits.max_rollouts:
        raise LimitExceeded(
            f"the request has {len(rollouts)} rollouts; the limit is {limits.max_rollouts} "
            "(ADV_MAX_REQUEST_ROLLOUTS): split the batch",
            field="rollouts",
        )
    tokens = 0
    for rollout in rollouts:
        index = _marker_index(rollout.get("tokens"), marker)
        if index is not None:
            tokens += _count(body, spans[index])
        elif isinstance(rollout.get("tokens"), list):
            tokens += len(rollout["tokens"])
    if tokens > limits.max_tokens:
        raise LimitExceeded(
            f"the request has {tokens} tokens; the limit is {limits.max_tokens} "
            "(ADV_MAX_REQUEST_TOKENS): split the batch",
            field="tokens",
        )


def _numbers(body: bytes, span: tuple[int, int], integers_only: bool) -> Any:
    """An array of numbers from the body: numpy when numpy reads it exactly, else json's list.
    ``integers_only``: an array with a non-integer takes json's (token ids: its error names the
    element, and 2.0 is not an integer there)."""
    start, end = span
    inner = body[start + 1 : end - 1]
    expected = _count(body, span)
    if expected == 0:
        return np.zeros(0, np.int64)
    integers = _INTEGERS_ONLY.fullmatch(inner) is not None
    if (integers or not integers_only) and not (integers and _LONG_INTEGER.search(inner)):
        try:
            values = np.fromstring(inner, dtype=np.int64 if integers else np.float64, sep=",")
        except (ValueError, DeprecationWarning):
            values = None
        if values is not None and values.size == expected:
            return values
    return loads(body[start:end])


def _resolve(skeleton: Any, body: bytes, spans: list[tuple[int, int]], marker: str) -> Any:
    """The skeleton with its markers replaced: numpy arrays in rollouts, lists elsewhere.
    (Iterative, so that no depth json accepted can overflow the stack here.)"""
    in_rollout: set[int] = set()
    for rollout in _rollouts(skeleton):
        in_rollout.add(id(rollout))
        teacher = rollout.get("teacher_logprobs")
        if isinstance(teacher, dict):
            in_rollout.add(id(teacher))
    root = [skeleton]
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        numpy_ok = id(node) in in_rollout
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in list(items):
            index = _marker_index(value, marker)
            if index is not None:
                start, end = spans[index]
                if numpy_ok:
                    node[key] = _numbers(body, (start, end), integers_only=key == "tokens")
                else:
                    node[key] = loads(body[start:end])
            elif isinstance(value, dict | list):
                stack.append(value)
    return root[0]
