"""One pass over a JSON request body's bytes, refusing what it may not hold before decoding.

msgspec (wire/jsonio.py) checks a string's length or an array's size only once it has built it
(a 10 MB group id costs 10 MB before its refusal) and counts nothing across a request. This pass
follows the body's structure, one regex ``search`` per string or bracket (:data:`_TOKEN`) and an
array of numbers at a time (its commas counted, its text checked a chunk at a time), and refuses
where it meets them (the bounds and their words: wire/json_limits.py): a string over its field's
length, the groups, rollouts and tokens, more values of a per-token field than tokens may be,
teacher conditions, ``return`` names, ``ignore_token_ids``, an estimator over 16 KiB, nesting
too deep, an object of too many fields, an unknown top-level field, too much JSON where the
schema has none, data after the request. Over the rollout or token limit it counts on to the
end, so that the refusal gives the request's counts as the other transports do. It holds a
frame per open bracket and a few counters; each repetition in the regex is bounded or over one
character class, so no match holds more than a few kilobytes of the regex engine's state (an
unbounded ``(?:[^"\\]|\\.)*`` costs ~130 bytes per character of a long string). What is not
JSON it leaves to the decoder, which says where.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
from advantage_contract.fields import (
    GROUP_FIELDS,
    MAX_REWARD_COMPONENTS,
    REWARD_COMPONENTS_FIELD,
)
from advantage_contract.flat import (
    MAX_GROUP_ID_LENGTH,
    MAX_TEACHER_CONDITIONS,
    ROLLOUT_FIELDS,
    TOKEN_FIELDS,
    TOP_LEVEL_FIELDS,
)

from ..errors import is_text
from . import json_limits
from .json_limits import MAX_DEPTH, MAX_FIELDS, MAX_UNEXPECTED_BYTES, BodyLimits
from .request import (
    MAX_ESTIMATOR_JSON_BYTES,
    MAX_IGNORE_TOKEN_IDS,
    MAX_NAME_LENGTH,
    MAX_NAMESPACE_LENGTH,
    MAX_REQUEST_ID_LENGTH,
    MAX_RETURN_NAMES,
)

# A string of at most this many units (one byte, or one escape pair such as \n or the \u of
# \uXXXX) is matched whole: a character is at most 10 units (\uD83D\uDE00).
STRING_UNITS = 10 * MAX_GROUP_ID_LENGTH
_TOKEN = re.compile(
    rb'("(?:[^"\\]|\\.){0,%d}")([ \t\n\r]*:)?'
    rb'|(")'
    rb"|([\[{])"
    rb"|([\]}])" % STRING_UNITS,
    re.DOTALL,
)
_STRING, _KEY, _QUOTE, _OPEN, _CLOSE = range(1, 6)  # (the token's last group)
_BLANK = re.compile(rb"[ \t\n\r]*")
# The text of an array of numbers (less its brackets), checked this many bytes at a time:
# ``translate`` deleting all of it leaves nothing (deleting every byte runs several times
# faster than keeping the commas, a branch the processor cannot predict).
_NUMBER_TEXT = b"-0123456789.eE+ \t\n\r,"
_CHUNK = 1 << 16
# From this many bytes numpy counts an array's commas (bytes.count takes ~0.7 ns a byte of
# number text, numpy's comparison ~0.1); below, its fixed cost per call is the larger.
_NUMPY_COUNT = 4096


@dataclass(frozen=True)
class BodyShape:
    """What the pass saw of a body within its bounds."""

    root_keys: list[str]  # the top-level keys, in the order they first appear (as json keeps)
    # Every group and rollout gives its fields in the order of GROUP_FIELDS and ROLLOUT_FIELDS,
    # each once: decoded into Structs of those fields, they keep the body's order.
    in_order: bool


def check_body(body: bytes, limits: BodyLimits) -> BodyShape:
    """Refuse ``body`` (a :class:`RequestError`) at the first bound it breaks."""
    guard = _Guard(body, limits)
    guard.run()
    return BodyShape(guard.root_keys, guard.in_order)


# What a value is expected to be, from where it sits (the roles of frames and values).
_ROOT, _GROUPS, _GROUP, _ROLLOUTS, _ROLLOUT, _TEACHER, _ESTIMATOR, _RETURN, _OTHER = range(9)
_PER_TOKEN, _IGNORE, _REQUEST_ID, _NAMESPACE, _GROUP_ID, _NAME, _ANY = range(9, 16)
_COMPONENTS = 16  # a rollout's reward_components: names -> numbers (or null)
_PER_TOKEN_FIELDS = ("tokens", *TOKEN_FIELDS)
# The role of an object's field's value, and of an array's elements.
_FIELD_ROLES = {
    _ROOT: {"groups": _GROUPS, "estimator": _ESTIMATOR, "return": _RETURN},
    _GROUP: {"id": _GROUP_ID, "rollouts": _ROLLOUTS},
    _ROLLOUT: {
        **dict.fromkeys(_PER_TOKEN_FIELDS, _PER_TOKEN),
        "teacher_logprobs": _TEACHER,
        REWARD_COMPONENTS_FIELD: _COMPONENTS,
    },
}
_FIELD_ROLES[_ROOT].update(ignore_token_ids=_IGNORE, request_id=_REQUEST_ID, namespace=_NAMESPACE)
_ELEMENTS = {_GROUPS: (_GROUP, "groups"), _ROLLOUTS: (_ROLLOUT, "rollouts")}
_ELEMENTS[_RETURN] = (_NAME, "return")
_OBJECT_ROLES = (_ROOT, _GROUP, _ROLLOUT, _TEACHER, _COMPONENTS)
_COUNTED = (_GROUPS, _ROLLOUTS, _RETURN)  # arrays whose elements are counted from their commas
_KNOWN = {_ROOT: TOP_LEVEL_FIELDS, _GROUP: GROUP_FIELDS, _ROLLOUT: ROLLOUT_FIELDS}
_RANKS = {role: {name: i for i, name in enumerate(_KNOWN[role])} for role in (_GROUP, _ROLLOUT)}
_ROLLOUT_RANKS = _RANKS[_ROLLOUT]
# Where a string too long is, in json_limits' words (by the role of its object, or its own).
_KEY_PLACES = {_TEACHER: "teacher_logprobs", _ROOT: "request", _ESTIMATOR: "estimator"}
_KEY_PLACES[_COMPONENTS] = REWARD_COMPONENTS_FIELD
_KEY_PLACES.update({_GROUP: "group", _ROLLOUT: "rollout"})
_VALUE_PLACES = {_NAMESPACE: "namespace", _GROUP_ID: "id", _REQUEST_ID: "request_id"}
_VALUE_PLACES.update({_ESTIMATOR: "name", _NAME: "name"})
_STRING_LIMITS = {
    _NAMESPACE: MAX_NAMESPACE_LENGTH,
    _ESTIMATOR: MAX_NAME_LENGTH,
    _NAME: MAX_NAME_LENGTH,
    _REQUEST_ID: MAX_REQUEST_ID_LENGTH,
}  # (any other string: MAX_GROUP_ID_LENGTH, the longest a request holds)


class _Frame:
    """An open object or array."""

    __slots__ = ("commas", "field", "key", "keys", "rank", "role", "start")

    def __init__(self, role: int, start: int, field: str | None) -> None:
        self.role = role
        self.start = start
        self.field = field  # the request field it is (for errors)
        self.key: str | None = None  # an object's key whose value comes next
        self.keys = 0  # an object's keys so far
        self.rank = -1  # a group's or rollout's last key's place among its known fields
        self.commas = 0  # an array's commas so far (groups, rollouts, return)


class _Guard:
    """One pass over a request body (see :func:`check_body`)."""

    def __init__(self, body: bytes, limits: BodyLimits) -> None:
        self.body = body
        self.limits = limits
        self.over = False  # over the token or rollout limit: counting to the end
        self.stack: list[_Frame] = []
        self.root_done = False
        self.root_keys: list[str] = []
        self.in_order = True
        self.groups = 0  # group objects opened
        self.group_id: str | None = None  # the current group's id, once seen (for errors)
        self.rollouts = 0  # rollouts counted: closed rollouts arrays' elements
        self.rollouts_seen = 0  # and with the open one's
        self.rollout_index = -1  # the current rollout's index in its group
        self.tokens = 0
        self.values: dict[str, int] = {}  # per-token field -> values counted
        self.conditions: set[str] = set()
        self.components: set[str] = set()  # reward component names
        self.unexpected = 0  # bytes of JSON where the schema has none so far
        self.region: _Frame | None = None  # the estimator or unexpected value being passed
        self.keys: dict[bytes, str | None] = {}  # keys decoded so far

    def run(self) -> None:
        body, search, stack, known = self.body, _TOKEN.search, self.stack, self.keys
        pos, size = 0, len(body)
        while True:  # (the hot loop of a request of many rollouts: their tokens inline)
            match = search(body, pos)
            start = size if match is None else match.start()
            if start > pos and stack and (self.region is not None or stack[-1].role in _COUNTED):
                self._gap(pos, start)
            if match is None:
                break
            if self.root_done:
                raise json_limits.not_json("extra data after it")
            pos = match.end()
            kind = match.lastindex
            frame = stack[-1] if stack else None
            if kind == _KEY:
                key = known.get(match.group(_STRING))
                if (
                    key is not None
                    and frame is not None
                    and frame.role == _ROLLOUT
                    and frame.keys < MAX_FIELDS
                ):  # (a key seen before, checked then: only its place to note)
                    frame.key = key
                    frame.keys += 1
                    rank = _ROLLOUT_RANKS.get(key, -1)
                    if rank <= frame.rank:
                        self.in_order = False
                    frame.rank = rank
                else:
                    self._key(frame, match.group(_STRING))
            elif kind == _CLOSE:
                if frame is not None and frame.role == _ROLLOUT:
                    stack.pop()  # (a rollout's end: nothing to count)
                else:
                    self._close(start)
            elif (
                kind == _OPEN
                and frame is not None
                and frame.role == _ROLLOUTS
                and body[start] == 0x7B
            ):
                self._open_rollout(frame, start)  # (the hot loop's: a rollout opens)
            elif kind == _OPEN and body[start] == 0x5B and (numbers := self._numbers(start)):
                end, count = numbers
                if frame is not None and frame.role == _ROLLOUT and frame.key in _PER_TOKEN_FIELDS:
                    self._per_token(frame.key, count)
                else:
                    self._array(*self._expect(frame), start, end, count)
                pos = end
            else:
                pos = self._token(match, kind)
        if self.over:
            raise json_limits.over_counts(
                max(self.rollouts, self.rollouts_seen),
                self.tokens,
                self.values,
                self.limits.max_rollouts,
                self.limits.max_tokens,
            )

    def _numbers(self, start: int) -> tuple[int, int] | None:
        """(end, values) of the array at ``start`` when it holds numbers only (None when not):
        its values from its commas (0 for an empty one), without copying more of it than a
        chunk at a time."""
        body = self.body
        end = body.find(b"]", start)
        if end < 0:
            return None
        for chunk in range(start + 1, end, _CHUNK):
            if body[chunk : min(chunk + _CHUNK, end)].translate(None, _NUMBER_TEXT):
                return None
        commas = _count_commas(body, start + 1, end)
        if not commas and _BLANK.fullmatch(body, start + 1, end):
            return end + 1, 0
        return end + 1, commas + 1

    def _gap(self, start: int, end: int) -> None:
        """Punctuation and scalars between two tokens: commas of the arrays that are counted,
        and the size of the region they are in."""
        frame = self.stack[-1]
        if frame.role in _COUNTED:
            commas = self.body.count(b",", start, end)
            if commas:
                frame.commas += commas
                self._check_elements(frame)
        self._check_region(end)

    def _token(self, match: re.Match[bytes], kind: int | None) -> int:
        """A string value, or a bracket that opens; where the pass goes on."""
        start, end = match.span()
        parent = self.stack[-1] if self.stack else None
        if kind == _QUOTE:  # a quote where no bounded string ends: longer than any string may be
            end = string_end(self.body, start)
            if end < 0:
                raise json_limits.not_json("a string is not terminated")
            blank = _BLANK.match(self.body, end)
            colon = blank.end() if blank is not None else end
            if colon < len(self.body) and self.body[colon] == ord(":"):
                self._long_key(parent, f"more than {MAX_GROUP_ID_LENGTH} characters")
            self._long_value(parent, f"more than {MAX_GROUP_ID_LENGTH} characters")
        role, field = self._expect(parent)
        if kind == _STRING:
            self._value_string(role, match.group(_STRING))
        else:
            self._open(role, field, start)
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
        if role in _ELEMENTS:
            return _ELEMENTS[role]
        if role == _TEACHER:
            return _PER_TOKEN, f"teacher_logprobs.{key}"
        return _FIELD_ROLES.get(role, {}).get(key or "", _ANY), key

    def _open(self, role: int, field: str | None, start: int) -> None:
        expected = role in _OBJECT_ROLES if self.body[start] == ord("{") else role in _COUNTED
        if role != _ESTIMATOR and not expected:
            role = _OTHER  # JSON where the schema has none: decoded for its error, bounded
        frame = _Frame(role, start, field)
        if len(self.stack) >= MAX_DEPTH:
            raise json_limits.too_deep()
        if role in (_ESTIMATOR, _OTHER) and self.region is None:
            self.region = frame
        elif role == _GROUP:
            self.groups += 1
            self.group_id = None
            self.rollout_index = -1
        elif role == _ROLLOUT:
            self.rollout_index += 1
        if role in (_GROUP, _ROLLOUT) and self.stack:
            self._check_elements(self.stack[-1])  # (the groups or rollouts array it is in)
        self.stack.append(frame)

    def _open_rollout(self, rollouts: _Frame, start: int) -> None:
        """A rollout's object opens, in its group's rollouts (what _open does, the short way)."""
        if len(self.stack) >= MAX_DEPTH:
            raise json_limits.too_deep()
        self.rollout_index += 1
        self._check_elements(rollouts)
        self.stack.append(_Frame(_ROLLOUT, start, "rollouts"))

    def _close(self, start: int) -> None:
        if not self.stack:
            return  # (unbalanced: the decoder says where)
        frame = self.stack.pop()
        if frame.role == _ROLLOUTS and not _BLANK.fullmatch(self.body, frame.start + 1, start):
            self.rollouts += frame.commas + 1
        if frame is self.region:
            self._check_region(start + 1)
            if frame.role == _OTHER:
                self.unexpected += start + 1 - frame.start
            self.region = None
        if not self.stack:
            self.root_done = True

    def _key(self, frame: _Frame | None, raw: bytes) -> None:
        key = self.keys.get(raw)
        if key is None:
            key = _decode_string(raw)
            if len(self.keys) < 256 and key is not None and len(key) <= MAX_NAME_LENGTH:
                self.keys[raw] = key  # (the same few keys repeat in every rollout)
        if frame is None:
            return  # (a key outside any object: the decoder says where)
        frame.key = key
        if key is None:
            return  # (not text: the request's text check names it)
        frame.keys += 1
        role = frame.role
        if len(key) > MAX_NAME_LENGTH:
            self._long_key(frame, f"{len(key)} characters")
        if role in _RANKS:
            rank = _RANKS[role].get(key, -1)
            self.in_order = self.in_order and rank > frame.rank
            frame.rank = rank
        if role == _ROOT:
            if key not in TOP_LEVEL_FIELDS:
                raise json_limits.unknown_field(key)
            if key not in self.root_keys:
                self.root_keys.append(key)
        if role == _TEACHER:
            if key not in self.conditions or frame.keys > MAX_TEACHER_CONDITIONS:
                self.conditions.add(key)
                if len(self.conditions) > MAX_TEACHER_CONDITIONS:
                    raise json_limits.too_many_conditions(self._where())
        elif role == _COMPONENTS:
            if key not in self.components or frame.keys > MAX_REWARD_COMPONENTS:
                self.components.add(key)
                if len(self.components) > MAX_REWARD_COMPONENTS:
                    raise json_limits.too_many_components(self._where())
        elif role in _OBJECT_ROLES and frame.keys > MAX_FIELDS:
            what = {_ROOT: "the request", _GROUP: "a group", _ROLLOUT: "a rollout"}[role]
            raise json_limits.too_many_fields(what, key, MAX_FIELDS, self._where())

    # ---- values ------------------------------------------------------------------------------

    def _value_string(self, role: int, raw: bytes) -> None:
        limit = _STRING_LIMITS.get(role, MAX_GROUP_ID_LENGTH)
        if len(raw) - 2 > limit:  # (a character is at least one byte)
            value = _decode_string(raw)
            if value is not None and len(value) > limit:
                self._long_value(self.stack[-1] if self.stack else None, f"{len(value)} characters")
        if role == _GROUP_ID:
            self.group_id = _decode_string(raw)

    def _array(self, role: int, field: str | None, start: int, end: int, count: int) -> None:
        """An array of numbers only, but a rollout's."""
        if role == _PER_TOKEN:
            self._per_token(field, count)
        elif role == _IGNORE and count > MAX_IGNORE_TOKEN_IDS:
            raise json_limits.too_many_ignored(count)
        elif role == _ESTIMATOR and self.region is None:
            self._check_size(_ESTIMATOR, field, end - start)
        elif role not in (_ESTIMATOR, _OTHER, _IGNORE):
            # (a list of numbers where the schema has none: groups, rollouts, a reward...)
            self.unexpected += end - start
            self._check_unexpected(field, self.unexpected)
        if self.region is not None:
            self._check_region(end)

    def _per_token(self, field: str | None, count: int) -> None:
        """A rollout's per-token array of numbers: counted."""
        name = field or "tokens"
        if name == "tokens":
            self.tokens += count
            total = self.tokens
        else:  # (one value per token: more than the token limit is never right)
            total = self.values[name] = self.values.get(name, 0) + count
        if total > self.limits.max_tokens:
            self.over = True

    # ---- limits ------------------------------------------------------------------------------

    def _where(self) -> json_limits.Where:
        """group_id (when seen yet) and rollout_index of where the pass is."""
        where: json_limits.Where = {"group_id": self.group_id}
        if any(f.role == _ROLLOUT for f in self.stack):
            where["rollout_index"] = self.rollout_index
        return where

    def _check_elements(self, frame: _Frame) -> None:
        elements, limit = frame.commas + 1, self.limits.max_rollouts
        if frame.role == _GROUPS and elements > limit:
            raise json_limits.too_many_groups(limit)
        if frame.role == _ROLLOUTS and self.rollouts + elements > limit:
            self.rollouts_seen = max(self.rollouts_seen, self.rollouts + elements)
            self.over = True
        if frame.role == _RETURN and elements > MAX_RETURN_NAMES:
            raise json_limits.too_many_return_names()

    def _check_region(self, pos: int) -> None:
        region = self.region
        if region is not None:
            self._check_size(region.role, region.field, pos - region.start)

    def _check_size(self, role: int, field: str | None, size: int) -> None:
        if role == _ESTIMATOR and size > MAX_ESTIMATOR_JSON_BYTES:
            raise json_limits.estimator_too_large()
        if role == _OTHER:
            self._check_unexpected(field, self.unexpected + size)

    def _check_unexpected(self, field: str | None, size: int) -> None:
        if size > MAX_UNEXPECTED_BYTES:
            parent = next((f for f in reversed(self.stack) if f.role != _OTHER), None)
            known = _KNOWN.get(parent.role, ()) if parent is not None else ()
            raise json_limits.unexpected_json(field, known, MAX_UNEXPECTED_BYTES, self._where())

    def _long_key(self, frame: _Frame | None, chars: str) -> NoReturn:
        """Refuse a key of ``chars`` (longer than any name), naming where it is."""
        place = _KEY_PLACES.get(frame.role, "") if frame is not None else ""
        field = frame.field if frame is not None else None
        raise json_limits.long_key(place, field, chars, self._where())

    def _long_value(self, frame: _Frame | None, chars: str) -> NoReturn:
        """Refuse a string value of ``chars`` (over its field's limit)."""
        role, field = self._expect(frame)
        place = _VALUE_PLACES.get(role, "")
        if role == _ESTIMATOR and frame is not None and frame.role == _ROOT:
            place = "preset"
        limit = _STRING_LIMITS.get(role, MAX_GROUP_ID_LENGTH)
        raise json_limits.long_value(place, field, chars, limit, self._where(), self.groups - 1)


def _count_commas(text: bytes, start: int, end: int) -> int:
    """The commas in ``text[start:end]``, counted in place (a chunk's comparison at a time)."""
    if end - start < _NUMPY_COUNT:
        return text.count(b",", start, end)
    view = np.frombuffer(text, np.uint8, end - start, start)
    return sum(
        int(np.count_nonzero(view[i : i + _CHUNK] == 0x2C)) for i in range(0, view.size, _CHUNK)
    )


def string_end(body: bytes, start: int) -> int:
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


def _decode_string(raw: bytes) -> str | None:
    """A short JSON string's value (None when it is not valid JSON, or not text: the decoder
    says so later, or the request's text check names it; a refusal here never repeats it)."""
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
