"""JSON text for the contract: numpy arrays become lists, and parse errors become RequestErrors.

One float formatting everywhere (HTTP, gRPC's JSON fields, Arrow metadata, the CLI): orjson's,
each float32 value in its shortest float32 repr (``0.70710576``, not ``0.7071057558059692``) and
float64 values in their shortest repr (``1e-6``).
"""

from __future__ import annotations

import json
import re
import secrets
from array import array
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from advantage_client.flat import (
    MAX_CONDITION_NAME_LENGTH,
    MAX_GROUP_ID_LENGTH,
    MAX_TEACHER_CONDITIONS,
    ROLLOUT_FIELDS,
    TOKEN_FIELDS,
    TOP_LEVEL_FIELDS,
)

from ..errors import LimitExceeded, RequestError, is_text, shown
from .request import (
    MAX_ESTIMATOR_JSON_BYTES,
    MAX_IGNORE_TOKEN_IDS,
    MAX_NAME_LENGTH,
    MAX_NAMESPACE_LENGTH,
    MAX_REQUEST_ID_LENGTH,
    MAX_RETURN_NAMES,
)


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


def loads(text: str | bytes | bytearray) -> Any:
    """Parse request JSON; malformed text raises RequestError (code ``invalid_json``).

    Bytes that are not UTF-8 inside a string do not make the JSON malformed here: they
    are decoded with ``surrogateescape`` (each such byte a lone surrogate, as ``json`` makes
    of a ``"\\ud800"`` escape), so that the request's text check (wire/text.py) refuses the
    string naming its field."""
    try:
        if isinstance(text, bytes | bytearray):
            encoding = json.detect_encoding(text)
            # (json itself decodes with surrogatepass: an encoded surrogate would pass)
            errors = "surrogateescape" if encoding.startswith("utf-8") else "surrogatepass"
            text = text.decode(encoding, errors)
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError("invalid_json", f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # (in gRPC's estimator_json, Arrow's metadata, ...)
        raise RequestError("invalid_json", "the JSON is nested too deeply to be a request") from exc
    except ValueError as exc:  # integers of more than 4300 digits
        raise RequestError("invalid_json", f"the JSON is not usable: {exc}") from exc


# ---- request bodies: bounded before anything is built ------------------------------------------

# One token of the scan, found by ``search`` from where the last one ended (what lies between two
# tokens is punctuation and scalars, copied through): an array of numbers only (the per-token
# lists), a string of at most _STRING_UNITS units (a unit: one byte, or one escape pair such as
# \n or the \u of \uXXXX) with the colon that makes it a key, a quote where no string that short
# ends (a longer string, or an unterminated one), or a bracket. Every repetition is bounded or
# over a single character class, so no match holds more than a few kilobytes of the regex
# engine's backtracking state, whatever the body holds (an unbounded (?:[^"\\]|\\.)* costs ~130
# bytes per character of a long string).
_STRING_UNITS = 10 * MAX_GROUP_ID_LENGTH  # a character is at most 10 units (\uD83D\uDE00)
_TOKEN = re.compile(
    rb"(\[[-0-9.eE+,\ \t\n\r]*\])"
    rb'|("(?:[^"\\]|\\.){0,%d}")([ \t\n\r]*:)?'
    rb'|(")'
    rb"|([\[{])"
    rb"|([\]}])" % _STRING_UNITS,
    re.DOTALL,
)
_BLANK = re.compile(rb"[ \t\n\r]*")
_INTEGERS_ONLY = re.compile(rb"[-0-9,\ \t\n\r]*")
# Integers of more digits than this might not fit int64: such an array takes the exact path.
_LONG_INTEGER = re.compile(rb"\d{19}")

# The deepest a request nests (its estimator object: 4) is far from this; json itself gives up
# near 1,000 levels, and the scan keeps one frame per level.
MAX_DEPTH = 64
# Keys an object of the request may have: the known fields and a few unknown ones (named by the
# error that refuses them), so that a key given again and again does not grow the skeleton.
MAX_FIELDS = 16
# JSON where the schema has none (an object for a reward, a list of lists for tokens, an
# unknown group field's value): kept for the error that names it, up to this much in all.
MAX_UNEXPECTED_BYTES = 1 << 20


@dataclass(frozen=True)
class BodyLimits:
    """What a request body may hold, checked before its numbers are parsed."""

    max_tokens: int
    max_rollouts: int


def loads_request(body: bytes, limits: BodyLimits | None = None) -> Any:
    """A request body parsed with its per-token arrays as numpy arrays, never as Python lists,
    refused (with ``limits``) as soon as the scan meets what the request may not hold.

    ``json.loads`` of a body of number lists costs 8-40x the body in Python objects (a float is
    24 bytes, plus 8 for its list slot), and it cannot stop early. Here one scan over the body
    (:data:`_TOKEN`, a bounded regex ``search`` per token) follows its structure, replaces each
    rollout's array of numbers with a marker, and with ``limits`` checks as it goes, before any
    object is built: string lengths (:func:`_string_limit`: ids 256 characters, names 64), the
    rollouts, groups and tokens (from the arrays' commas), the other per-token arrays' values,
    teacher conditions, ``return`` names and ``ignore_token_ids``, the estimator's size, the
    depth, unknown top-level fields, and JSON where the schema has none. The small skeleton
    left is parsed by ``json``, and only then is each array of a rollout parsed by numpy
    straight from the body's bytes (int64 when it holds integers only, else float64). Arrays
    elsewhere (``ignore_token_ids``) are json's lists, and so is an array numpy does not read
    exactly as ``json`` does (huge integers, odd forms) or token ids that are not all integers:
    without ``limits`` the result is what ``json.loads`` gives (for at most :data:`MAX_DEPTH`
    levels) but for the type of the rollouts' arrays (and, in their float arrays, 1 read as 1.0).
    """
    nonce = b"\\u0001" + secrets.token_hex(4).encode()
    scan = _Scan(body, limits, nonce)
    skeleton = loads(scan.run())
    marker = "\x01" + nonce[6:].decode()
    return _resolve(skeleton, body, scan.spans, marker)


# What a value is expected to be, from where it sits (the roles of _Scan's frames and values).
_ROOT, _GROUPS, _GROUP, _ROLLOUTS, _ROLLOUT, _TEACHER, _ESTIMATOR, _RETURN, _OTHER = range(9)
_PER_TOKEN, _IGNORE, _REQUEST_ID, _NAMESPACE, _GROUP_ID, _NAME, _ANY = range(9, 16)
_ROOT_ROLES = {
    "groups": _GROUPS,
    "estimator": _ESTIMATOR,
    "return": _RETURN,
    "ignore_token_ids": _IGNORE,
    "request_id": _REQUEST_ID,
    "namespace": _NAMESPACE,
}
_PER_TOKEN_FIELDS = ("tokens", *TOKEN_FIELDS)
_OBJECT_ROLES = (_ROOT, _GROUP, _ROLLOUT, _TEACHER)
_COUNTED = (_GROUPS, _ROLLOUTS, _RETURN)  # arrays whose elements are counted from their commas


class _Frame:
    """An open object or array of the scan."""

    __slots__ = ("commas", "field", "key", "keys", "role", "start")

    def __init__(self, role: int, start: int, field: str | None) -> None:
        self.role = role
        self.start = start
        self.field = field  # the request field it is (for errors)
        self.key: str | None = None  # an object's key whose value comes next
        self.keys = 0  # an object's keys so far
        self.commas = 0  # an array's commas so far (groups, rollouts, return)


class _Scan:
    """One scan of a request body (see :func:`loads_request`): ``run()`` gives the skeleton's
    JSON text, ``spans`` the (start, end) of each marker's array in the body.

    Over the token or rollout limit (or with more values of a per-token field than tokens may
    be), the scan goes on to the end keeping nothing, so that the refusal gives the request's
    counts (as the other transports do); any other problem is refused where it is met."""

    def __init__(self, body: bytes, limits: BodyLimits | None, nonce: bytes) -> None:
        self.body = body
        self.limits = limits
        self.nonce = nonce
        self.out = bytearray()  # the skeleton: the body up to ``copied``, markers for arrays
        self.copied = 0
        self.view = memoryview(body)
        self.over = False  # over the token or rollout limit: counting to the end
        self.spans = array("q")
        self.stack: list[_Frame] = []
        self.root_done = False
        self.groups = 0  # group objects opened
        self.group_id: str | None = None  # the current group's id, once seen (for errors)
        self.rollouts = 0  # rollouts counted: closed rollouts arrays' elements
        self.rollouts_seen = 0  # and with the open one's
        self.rollout_index = -1  # the current rollout's index in its group
        self.tokens = 0
        self.values: dict[str, int] = {}  # per-token field -> values counted
        self.conditions: set[str] = set()
        self.unexpected = 0  # bytes of JSON where the schema has none, kept so far
        self.region: _Frame | None = None  # the estimator or unexpected value being scanned
        self.keys: dict[bytes, str | None] = {}  # keys decoded so far

    # ---- the scan --------------------------------------------------------------------------

    def run(self) -> bytearray:
        body, search, stack = self.body, _TOKEN.search, self.stack
        strict = self.limits is not None
        known = self.keys
        pos, size = 0, len(body)
        while True:  # (the hot loop of a request of many rollouts: their tokens inline)
            match = search(body, pos)
            start = size if match is None else match.start()
            if (
                start > pos
                and strict
                and stack
                and (self.region is not None or stack[-1].role in _COUNTED)
            ):
                self._gap(pos, start)
            if match is None:
                break
            if self.root_done:
                if strict:
                    raise RequestError(
                        "invalid_json", "request body is not valid JSON: extra data after it"
                    )
                break
            pos = match.end()
            kind = match.lastindex
            frame = stack[-1] if stack else None
            if kind == 3:  # a string with its colon: a key
                key = known.get(match.group(2))
                if (
                    key is not None
                    and frame is not None
                    and frame.role == _ROLLOUT
                    and (frame.keys < MAX_FIELDS)
                ):  # (a key seen before, checked then: nothing to check for a rollout)
                    frame.key = key
                    frame.keys += 1
                else:
                    self._key(frame, match.group(2), start)
            elif (
                kind == 1
                and frame is not None
                and frame.role == _ROLLOUT
                and (frame.key in _PER_TOKEN_FIELDS)
            ):
                self._per_token(frame.key, start, pos)
            elif kind == 6:
                if frame is not None and frame.role == _ROLLOUT:
                    stack.pop()  # (a rollout's end: nothing to count)
                else:
                    self._close(start)
            else:
                pos = self._token(match, kind)
        if self.over:
            self._refuse_counts()
        self.out += self.view[self.copied :]
        return self.out

    def _gap(self, start: int, end: int) -> None:
        """Punctuation and scalars between two tokens: commas of the arrays that are counted,
        and the size of the region they are in."""
        if self.limits is None or not self.stack:
            return
        frame = self.stack[-1]
        if frame.role in _COUNTED:
            commas = self.body.count(b",", start, end)
            if commas:
                frame.commas += commas
                self._check_elements(frame)
        self._check_region(end)

    def _token(self, match: re.Match[bytes], kind: int | None) -> int:
        """Handle a token other than a key or a closing bracket; where the scan goes on."""
        start, end = match.span()
        parent = self.stack[-1] if self.stack else None
        if kind == 4:  # a quote where no bounded string ends: find where this one does
            end = _string_end(self.body, start)
            if end < 0:
                raise RequestError(
                    "invalid_json", "request body is not valid JSON: a string is not terminated"
                )
            blank = _BLANK.match(self.body, end)
            colon = blank.end() if blank is not None else end
            is_key = colon < len(self.body) and self.body[colon] == ord(":")
            self._too_long(parent, is_key, None, start)
            return end
        role, field = self._expect(parent)
        if kind == 2:
            self._value_string(role, match.group(2), start)
        elif kind == 1:
            self._numbers(role, field, start, end)
        else:
            self._open(role, field, start, end)
        if self.region is not None:
            self._check_region(end)
        return end

    # ---- structure ---------------------------------------------------------------------------

    def _expect(self, parent: _Frame | None) -> tuple[int, str | None]:
        """The role of the value that starts here and the request field it is."""
        if parent is None:
            return _ROOT, None
        role, key = parent.role, parent.key
        if role in (_ESTIMATOR, _OTHER):
            return role, parent.field
        if role == _ROOT:
            return _ROOT_ROLES.get(key or "", _ANY), key
        if role == _GROUPS:
            return _GROUP, "groups"
        if role == _GROUP:
            return {"id": _GROUP_ID, "rollouts": _ROLLOUTS}.get(key or "", _ANY), key
        if role == _ROLLOUTS:
            return _ROLLOUT, "rollouts"
        if role == _ROLLOUT:
            if key in _PER_TOKEN_FIELDS:
                return _PER_TOKEN, key
            return (_TEACHER if key == "teacher_logprobs" else _ANY), key
        if role == _TEACHER:
            return _PER_TOKEN, f"teacher_logprobs.{key}"
        if role == _RETURN:
            return _NAME, "return"
        return _ANY, key

    def _open(self, role: int, field: str | None, start: int, end: int) -> None:
        opener = self.body[start]
        is_object = opener == ord("{")
        expected_object = role in _OBJECT_ROLES
        expected_array = role in (_GROUPS, _ROLLOUTS, _RETURN)
        if role != _ESTIMATOR and not (
            (is_object and expected_object) or (not is_object and expected_array)
        ):
            role = _OTHER  # JSON where the schema has none: kept for its error, bounded
        frame = _Frame(role, start, field)
        if len(self.stack) >= MAX_DEPTH:
            raise RequestError("invalid_json", "the JSON is nested too deeply to be a request")
        if role in (_ESTIMATOR, _OTHER) and self.region is None:
            self.region = frame
        elif role == _GROUP:
            self.groups += 1
            self.group_id = None
            self.rollout_index = -1
        elif role == _ROLLOUT:
            self.rollout_index += 1
        if self.limits is not None and role in (_GROUP, _ROLLOUT) and self.stack:
            self._check_elements(self.stack[-1])  # (the groups or rollouts array it is in)
        self.stack.append(frame)

    def _close(self, start: int) -> None:
        if not self.stack:
            return  # (unbalanced: json says where)
        frame = self.stack.pop()
        if self.limits is not None:
            if frame.role in (_GROUPS, _ROLLOUTS, _RETURN):
                nonempty = not _BLANK.fullmatch(self.body, frame.start + 1, start)
                if frame.role == _ROLLOUTS and nonempty:
                    self.rollouts += frame.commas + 1
            if frame is self.region:
                self._check_region(start + 1)
                if frame.role == _OTHER:
                    self.unexpected += start + 1 - frame.start
                self.region = None
        if not self.stack:
            self.root_done = True

    def _key(self, frame: _Frame | None, raw: bytes, start: int) -> None:
        key = self.keys.get(raw)
        if key is None:
            key = _decode_key(raw)
            if len(self.keys) < 256 and key is not None and len(key) <= MAX_NAME_LENGTH:
                self.keys[raw] = key  # (the same few keys repeat in every rollout)
        if frame is None:
            return  # (a key outside any object: json says where)
        frame.key = key
        if self.limits is None or key is None:
            return
        frame.keys += 1
        role = frame.role
        if len(key) > MAX_NAME_LENGTH:
            self._too_long(frame, True, len(key), start)
        if role == _ROOT and key not in TOP_LEVEL_FIELDS:
            raise RequestError(  # (the message parse_options gives, before the value is read)
                "unknown_field",
                f"unknown request field {shown(key)}; known: {list(TOP_LEVEL_FIELDS)}",
                field=key,
            )
        if role == _TEACHER:
            if key not in self.conditions or frame.keys > MAX_TEACHER_CONDITIONS:
                self.conditions.add(key)
                if len(self.conditions) > MAX_TEACHER_CONDITIONS:
                    raise LimitExceeded(
                        f"the request has more than {MAX_TEACHER_CONDITIONS} teacher_logprobs "
                        "conditions",
                        field="teacher_logprobs",
                        **self._where(),
                    )
        elif role in _OBJECT_ROLES and frame.keys > MAX_FIELDS:
            what = {_ROOT: "the request", _GROUP: "a group", _ROLLOUT: "a rollout"}[role]
            raise RequestError(
                "invalid_json",
                f"{what} has more than {MAX_FIELDS} fields (a field given more than once?)",
                field=key,
                **self._where(),
            )

    # ---- values ------------------------------------------------------------------------------

    def _value_string(self, role: int, raw: bytes, start: int) -> None:
        if self.limits is None:
            return
        limit = _string_limit(role)
        if len(raw) - 2 > limit:  # (a character is at least one byte)
            length = _string_length(raw)
            if length is not None and length > limit:
                self._too_long(self.stack[-1] if self.stack else None, False, length, start)
        if role == _GROUP_ID:
            self.group_id = _decode_key(raw)

    def _numbers(self, role: int, field: str | None, start: int, end: int) -> None:
        """An array of numbers only: a rollout's per-token values become a marker."""
        body, limits = self.body, self.limits
        if role == _PER_TOKEN:
            self._per_token(field, start, end)
            return
        if limits is not None:
            if role == _IGNORE:
                count = _count(body, start, end)
                if count > MAX_IGNORE_TOKEN_IDS:
                    raise LimitExceeded(
                        f"ignore_token_ids has {count} ids; the limit is {MAX_IGNORE_TOKEN_IDS}",
                        field="ignore_token_ids",
                    )
            elif role == _ESTIMATOR and self.region is None:
                self._check_region_size(_ESTIMATOR, field, end - start)
            elif role not in (_ESTIMATOR, _OTHER):
                # (a list of numbers where the schema has none: groups, rollouts, a reward...)
                self.unexpected += end - start
                self._check_unexpected(field, end - start)

    def _per_token(self, field: str | None, start: int, end: int) -> None:
        """A rollout's per-token array of numbers: counted, and a marker in the skeleton."""
        body, limits = self.body, self.limits
        if limits is not None:
            count = _count(body, start, end)
            name = field or "tokens"
            if name == "tokens":
                self.tokens += count
                if self.tokens > limits.max_tokens:
                    self._count_to_the_end()
            else:  # (one value per token: more than the token limit is never right)
                total = self.values.get(name, 0) + count
                self.values[name] = total
                if total > limits.max_tokens:
                    self._count_to_the_end()
        if not self.over:  # (over a limit: sure to be refused, nothing more is kept)
            self.spans.extend((start, end))
            self.out += self.view[self.copied : start]
            self.out += b'"%s%d"' % (self.nonce, len(self.spans) // 2 - 1)
            self.copied = end

    # ---- limits ------------------------------------------------------------------------------

    def _where(self) -> dict[str, Any]:
        """group_id (when seen yet) and rollout_index of where the scan is."""
        where: dict[str, Any] = {"group_id": self.group_id}
        if any(f.role == _ROLLOUT for f in self.stack):
            where["rollout_index"] = self.rollout_index
        return where

    def _check_elements(self, frame: _Frame) -> None:
        assert self.limits is not None
        elements = frame.commas + 1
        if frame.role == _GROUPS and elements > self.limits.max_rollouts:
            raise LimitExceeded(
                f"the request has more than {self.limits.max_rollouts} groups, and a group has "
                "at least one rollout; the limit is "
                f"{self.limits.max_rollouts} rollouts (ADV_MAX_REQUEST_ROLLOUTS): split the batch",
                field="groups",
            )
        if frame.role == _ROLLOUTS and self.rollouts + elements > self.limits.max_rollouts:
            self.rollouts_seen = max(self.rollouts_seen, self.rollouts + elements)
            self._count_to_the_end()
        if frame.role == _RETURN and elements > MAX_RETURN_NAMES:
            raise RequestError(  # (parse_options' answer: a 422, as for an unknown name)
                "invalid_parameter",
                f"return lists more than {MAX_RETURN_NAMES} names; at most {MAX_RETURN_NAMES} "
                "may be asked for",
                field="return",
            )

    def _count_to_the_end(self) -> None:
        self.over = True

    def _refuse_counts(self) -> None:
        """The refusal of a request over the rollout or token limit (or with more values of a
        per-token field than that), with its counts (the engine's words, as gRPC gives them)."""
        assert self.limits is not None
        rollouts = max(self.rollouts, self.rollouts_seen)
        if rollouts > self.limits.max_rollouts:
            raise LimitExceeded(
                f"the request has {rollouts} rollouts; the limit is "
                f"{self.limits.max_rollouts} (ADV_MAX_REQUEST_ROLLOUTS): split the batch",
                field="rollouts",
            )
        if self.tokens > self.limits.max_tokens:
            raise LimitExceeded(
                f"the request has {self.tokens} tokens; the limit is {self.limits.max_tokens} "
                "(ADV_MAX_REQUEST_TOKENS): split the batch",
                field="tokens",
            )
        name, values = max(self.values.items(), key=lambda item: item[1])
        raise LimitExceeded(  # (one value per token: more than the token limit is never right)
            f"the request has {values} {name} values, one per token; the token limit is "
            f"{self.limits.max_tokens} (ADV_MAX_REQUEST_TOKENS)",
            field=name,
        )

    def _check_region(self, pos: int) -> None:
        region = self.region
        if region is not None and self.limits is not None:
            self._check_region_size(region.role, region.field, pos - region.start)

    def _check_region_size(self, role: int, field: str | None, size: int) -> None:
        if role == _ESTIMATOR and size > MAX_ESTIMATOR_JSON_BYTES:
            raise RequestError(  # (an estimator the registry cannot have: a 422, as gRPC's)
                "invalid_parameter",
                f"the estimator is more than {MAX_ESTIMATOR_JSON_BYTES} bytes of JSON; an "
                "estimator object is a few hundred",
                field="estimator",
            )
        if role == _OTHER:
            self._check_unexpected(field, self.unexpected + size)

    def _check_unexpected(self, field: str | None, size: int) -> None:
        if size <= MAX_UNEXPECTED_BYTES:
            return
        parent = next((f for f in reversed(self.stack) if f.role != _OTHER), None)
        known = _known_fields(parent.role) if parent is not None else ()
        if field is not None and known and field not in known:
            raise RequestError(
                "unknown_field",
                f"unknown field {shown(field)} with more than {MAX_UNEXPECTED_BYTES} bytes of "
                f"JSON; known: {list(known)}",
                field=field,
                **self._where(),
            )
        raise RequestError(
            "invalid_type",
            f"{field or 'the request'} holds more than {MAX_UNEXPECTED_BYTES} bytes of JSON "
            "of a type it does not take",
            field=field,
            **self._where(),
        )

    def _too_long(self, frame: _Frame | None, is_key: bool, length: int | None, start: int) -> None:
        """Refuse a string over its bound (``length`` characters; None: longer than any
        string a request holds), naming its field and not repeating it."""
        if self.limits is None:
            return
        chars = (
            f"{length} characters"
            if length is not None
            else (f"more than {MAX_GROUP_ID_LENGTH} characters")
        )
        where = self._where()
        role = frame.role if frame is not None else None
        if is_key:
            if role == _TEACHER:
                raise LimitExceeded(
                    f"a teacher_logprobs condition name has {chars}; the limit is "
                    f"{MAX_CONDITION_NAME_LENGTH}",
                    field="teacher_logprobs",
                    **where,
                )
            if role == _ROOT:
                raise RequestError(
                    "unknown_field",
                    f"unknown request field of {chars}; known: {list(TOP_LEVEL_FIELDS)}",
                    field="request",
                )
            if role == _ESTIMATOR:
                raise RequestError(
                    "invalid_parameter",
                    f"the estimator has a name of {chars}; names are at most {MAX_NAME_LENGTH}",
                    field="estimator",
                )
            field = frame.field if frame is not None else None
            if role in (_GROUP, _ROLLOUT):  # (no field of theirs has a name that long)
                raise RequestError(
                    "unknown_field",
                    f"{'a group' if role == _GROUP else 'a rollout'} has an unknown field of "
                    f"{chars}",
                    field=field,
                    **where,
                )
            raise LimitExceeded(
                f"{field or 'the request'} has a field name of {chars}; no field name is longer "
                f"than {MAX_NAME_LENGTH}",
                field=field,
                **where,
            )
        value_role, field = self._expect(frame)
        limit = _string_limit(value_role)
        if value_role == _NAMESPACE:
            raise RequestError(  # (parse_options' answer to the same)
                "invalid_type",
                f"namespace must be a non-empty string of at most {MAX_NAMESPACE_LENGTH} "
                "characters",
                field="namespace",
            )
        if value_role == _GROUP_ID:
            raise LimitExceeded(
                f"groups[{self.groups - 1}].id has {chars}; the limit is {limit}", field="id"
            )
        if value_role == _REQUEST_ID:
            raise LimitExceeded(f"request_id has {chars}; the limit is {limit}", field="request_id")
        if value_role in (_ESTIMATOR, _NAME):  # (a 422, as for any name the registry lacks)
            preset = value_role == _ESTIMATOR and role == _ROOT
            what = "preset" if preset else "name or value"
            raise RequestError(
                "unknown_estimator" if preset else "invalid_parameter",
                f"{field} has a {what} of {chars}; names are at most {limit}",
                field=field,
            )
        raise LimitExceeded(
            f"{field or 'the request'} has a string of {chars}; the limit is {limit}",
            field=field,
            **where,
        )


def _known_fields(role: int) -> tuple[str, ...]:
    return {
        _ROOT: TOP_LEVEL_FIELDS,
        _GROUP: ("id", "rollouts"),
        _ROLLOUT: ROLLOUT_FIELDS,
    }.get(role, ())


def _string_limit(role: int) -> int:
    """The longest string (characters) a value of ``role`` may be."""
    if role == _NAMESPACE:
        return MAX_NAMESPACE_LENGTH
    if role in (_ESTIMATOR, _NAME):
        return MAX_NAME_LENGTH
    if role == _REQUEST_ID:
        return MAX_REQUEST_ID_LENGTH
    return MAX_GROUP_ID_LENGTH  # group ids, and the longest any string of a request may be


def _string_end(body: bytes, start: int) -> int:
    """The end of the string whose opening quote is at ``start`` (-1: none), found without
    holding anything: the next quote not escaped by an odd run of backslashes."""
    pos = start + 1
    while True:
        quote = body.find(b'"', pos)
        if quote < 0:
            return -1
        run = quote
        while run > pos and body[run - 1] == 0x5C:  # (a run of backslashes before it)
            run -= 1
        if (quote - run) % 2 == 0:
            return quote + 1
        pos = quote + 1


def _decode_key(raw: bytes) -> str | None:
    """A short JSON string's value (None when it is not valid JSON, or not text: json says so
    later, or the request's text check names it; a scan's error never repeats it)."""
    if b"\\" not in raw:
        try:
            return raw[1:-1].decode()  # (strict: bytes that are not UTF-8 are None)
        except UnicodeDecodeError:
            return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, str) and is_text(value) else None


def _string_length(raw: bytes) -> int | None:
    decoded = _decode_key(raw)
    return None if decoded is None else len(decoded)


def _marker_index(value: Any, marker: str) -> int | None:
    if isinstance(value, str) and value.startswith(marker):
        try:
            return int(value[len(marker) :])
        except ValueError:
            return None
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


def _count(body: bytes, start: int, end: int) -> int:
    """The values of the array of numbers body[start:end], from its commas (0 for an empty
    one), without copying it."""
    if _BLANK.fullmatch(body, start + 1, end - 1):
        return 0
    return body.count(b",", start, end) + 1


def _numbers(body: bytes, start: int, end: int, integers_only: bool) -> Any:
    """An array of numbers from the body: numpy when numpy reads it exactly, else json's list.
    ``integers_only``: an array with a non-integer takes json's (token ids: its error names the
    element, and 2.0 is not an integer there)."""
    expected = _count(body, start, end)
    if expected == 0:
        return np.zeros(0, np.int64)
    integers = _INTEGERS_ONLY.fullmatch(body, start + 1, end - 1) is not None
    long_integer = integers and _LONG_INTEGER.search(body, start + 1, end - 1) is not None
    if (integers or not integers_only) and not long_integer:
        try:
            values = np.fromstring(  # (the slice is one array's text, parsed and dropped)
                body[start + 1 : end - 1], dtype=np.int64 if integers else np.float64, sep=","
            )
        except (ValueError, DeprecationWarning):
            values = None
        if values is not None and values.size == expected:
            return values
    return loads(body[start:end])


def _resolve(skeleton: Any, body: bytes, spans: array[int], marker: str) -> Any:
    """The skeleton with the rollouts' markers replaced by their arrays (the scan puts markers
    in rollouts and their teacher_logprobs only)."""
    for rollout in _rollouts(skeleton):
        nodes: list[dict[str, Any]] = [rollout]
        teacher = rollout.get("teacher_logprobs")
        if isinstance(teacher, dict):
            nodes.append(teacher)
        for node in nodes:
            for key, value in node.items():
                index = _marker_index(value, marker)
                if index is not None and 2 * index + 1 < len(spans):
                    start, end = spans[2 * index], spans[2 * index + 1]
                    tokens = key == "tokens" and node is rollout
                    node[key] = _numbers(body, start, end, integers_only=tokens)
    return skeleton
