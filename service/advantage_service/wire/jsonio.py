"""JSON text for the contract: numpy arrays become lists, parse errors become RequestErrors, and
request bodies are decoded by msgspec once wire/json_guard.py has checked their bounds.

One float formatting everywhere (HTTP, gRPC's JSON fields, Arrow metadata, the CLI): orjson's,
each float32 value in its shortest float32 repr (``0.70710576``, not ``0.7071057558059692``) and
float64 values in their shortest repr (``1e-6``).
"""

from __future__ import annotations

import codecs
import functools
import json
import re
import secrets
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import orjson
from advantage_contract.flat import TOKEN_FIELDS, TOP_LEVEL_FIELDS
from msgspec import UNSET, Raw, UnsetType

from ..errors import RequestError, is_text
from . import json_limits
from .json_guard import STRING_UNITS, BodyShape, check_body, string_end
from .json_limits import BodyLimits

__all__ = ["BodyLimits", "compile_readers", "dumps", "dumps_bytes", "loads", "loads_request"]


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


# ---- request bodies: bounded, then decoded by msgspec ------------------------------------------
#
# A request body is checked against its limits by wire/json_guard.py (one pass over its bytes,
# nothing built), then decoded by msgspec into the Structs below, each rollout's per-token arrays
# as msgspec.Raw (the array's bytes, where a list would cost a 32-byte Python number per value)
# parsed straight into numpy. The result is the dict ``json.loads`` gives, keys in the body's
# order (parse_request, shared with the in-process API, validates it and names what is wrong),
# but for the rollouts' arrays.
#
# The Structs read a body whose groups and rollouts give their fields in the Structs' order (the
# guard says so; a Struct keeps its own order) and of the types a valid request has. Any other
# body is read field by field (_loose: a reward given as text, an unknown group field, ...), kept
# for parse_request to name what is wrong. msgspec refuses three things json reads: NaN and
# Infinity, bytes that are not UTF-8 in a string, lone surrogate escapes; a body holding them is
# decoded with each replaced by a marker string (_marked), which the result then gets back.


class _Rollout(msgspec.Struct, forbid_unknown_fields=True):
    """A rollout (advantage_contract.flat.ROLLOUT_FIELDS, in that order): per-token arrays raw."""

    tokens: Raw = Raw()
    reward: int | float | UnsetType | None = UNSET
    logprobs: Raw = Raw()
    entropy: Raw = Raw()
    sum_pi_squared: Raw = Raw()
    is_weights: Raw = Raw()
    returns: Raw = Raw()
    planning_mask: Raw = Raw()
    teacher_logprobs: dict[str, Raw] | UnsetType | None = UNSET
    reward_components: dict[str, int | float | None] | UnsetType | None = UNSET


class _Group(msgspec.Struct, forbid_unknown_fields=True):
    """A group (GROUP_FIELDS, in that order)."""

    id: str | UnsetType | None = UNSET
    rollouts: list[_Rollout] | UnsetType | None = UNSET
    prompt_key: str | UnsetType | None = UNSET


class _Request(msgspec.Struct, forbid_unknown_fields=True):
    """The top level (TOP_LEVEL_FIELDS, in that order: the guard gives the body's); the
    estimator raw, read as json reads it (:func:`_value`: 1e999 is infinity there)."""

    request_id: str | UnsetType | None = UNSET
    namespace: str | UnsetType | None = UNSET
    estimator: Raw = Raw()
    ignore_token_ids: list[int] | UnsetType | None = UNSET
    vocab_size: int | UnsetType | None = UNSET
    return_: list[str] | UnsetType | None = msgspec.field(default=UNSET, name="return")
    groups: list[_Group] | UnsetType | None = UNSET


_REQUEST = msgspec.json.Decoder(_Request)
_FIELDS = msgspec.json.Decoder(dict[str, Raw])
_ITEMS = msgspec.json.Decoder(list[Raw])
_FLOATS = msgspec.json.Decoder(list[float])
_PER_TOKEN = frozenset(("tokens", *TOKEN_FIELDS))
# What _read_integers says of an array's text besides its values: it holds something but
# integers (a float, a string...), or an integer of 19 digits or more (one might not fit int64:
# the array is json's list then).
_NOT_INTEGERS, _TOO_LONG = -1, -2
_INT64_EXACT = 10**18  # (the least integer of 19 digits)
# The bytes _read_integers meets, less "0" (0x30): it tests a digit by one range check.
_COMMA, _MINUS = 0x2C - 0x30, 0x2D - 0x30
_BLANKS = (0x20 - 0x30, 0x09 - 0x30, 0x0A - 0x30, 0x0D - 0x30)  # space, tab, newline, return
# What a body msgspec refuses must hold for json to read it (see _marked).
_UNUSUAL = re.compile(rb"[\x80-\xff]|\\u[dD][89a-fA-F]|NaN|Infinity")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_LEXEME = re.compile(rb'"(?:[^"\\]|\\.){0,%d}"|"|-?Infinity|NaN' % STRING_UNITS, re.DOTALL)


def loads_request(body: bytes, limits: BodyLimits | None = None) -> Any:
    """A request body parsed as ``json.loads`` parses it, but for each rollout's per-token
    arrays (and its teacher_logprobs' arrays): numpy arrays, never Python lists (int64 when an
    array holds integers only, else float64; json's list where numpy would not read it exactly:
    integers of 19 digits or more, token ids that are not all integers, anything but numbers).

    With ``limits`` the body is first checked by :func:`json_guard.check_body`, which refuses
    what the request may not hold before anything of it is built. Without, deep nesting is
    refused as msgspec meets it (``invalid_json``), as ``json`` does."""
    body = _utf8(body)
    shape = check_body(body, limits) if limits is not None else None
    try:
        return _decode(body, shape)
    except msgspec.DecodeError as exc:
        failure = exc
    marked, literals, prefix = _marked(body)
    if literals:
        try:
            return _restored(_decode(marked, shape), literals, prefix)
        except msgspec.DecodeError as exc:
            failure = exc
    raise json_limits.not_json(str(failure)) from failure


def _utf8(body: bytes) -> bytes:
    """The body as UTF-8, as ``json.loads`` reads it: without a leading byte order mark, and
    UTF-16 and UTF-32 text re-encoded (a lone surrogate kept: the text check names it)."""
    encoding = json.detect_encoding(body)
    if encoding == "utf-8":
        return body
    if encoding == "utf-8-sig":
        return body[len(codecs.BOM_UTF8) :]
    try:
        return body.decode(encoding, "surrogatepass").encode("utf-8", "surrogatepass")
    except UnicodeError as exc:
        raise json_limits.not_json(str(exc)) from exc


def _decode(body: bytes, shape: BodyShape | None) -> Any:
    """The body through the Structs where the guard saw its objects' fields in their order,
    else (or when the body is no valid request) field by field."""
    try:
        if shape is not None and shape.in_order:
            try:
                return _typed(_REQUEST.decode(body), shape.root_keys)
            except msgspec.ValidationError:
                pass
        return _loose(body)
    except RecursionError as exc:
        raise json_limits.too_deep() from exc


def _typed(request: _Request, root_keys: list[str]) -> dict[str, Any]:
    """The decoded Structs as json's dicts, keys in the body's order. Each group and rollout
    takes its Struct's place in its list as it is made, so that both are not held whole at
    once (a Struct and its dict are ~0.3 KB each: 131,072 tiny rollouts)."""
    out: dict[str, Any] = {}
    names = [*root_keys, *(n for n in TOP_LEVEL_FIELDS if n not in root_keys)]
    for name in names:
        value = getattr(request, "return_" if name == "return" else name)
        if value is UNSET or (isinstance(value, Raw) and not value):
            continue
        if name == "groups" and value is not None:
            for g, group in enumerate(value):
                value[g] = _typed_group(group)
        elif isinstance(value, Raw):
            value = _value(value)
        out[name] = value
    return out


def _typed_group(group: _Group) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _Group.__struct_fields__:
        value = getattr(group, name)
        if name == "rollouts" and value:
            for r, rollout in enumerate(value):
                value[r] = _typed_rollout(rollout)
        if value is not UNSET:
            out[name] = value
    return out


def _typed_rollout(rollout: _Rollout) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in zip(
        _Rollout.__struct_fields__, msgspec.structs.astuple(rollout), strict=True
    ):
        if isinstance(value, Raw):
            if value:
                out[name] = _array(value, integers_only=name == "tokens")
        elif name == "teacher_logprobs" and value:
            out[name] = {k: _array(v, integers_only=False) for k, v in value.items()}
        elif value is not UNSET:
            out[name] = value
    return out


def _loose(body: bytes | Raw) -> Any:
    """The body read field by field as ``json`` reads it, the rollouts' arrays by numpy: a
    body the Structs do not take, kept for parse_request to name what is wrong."""
    fields = _object(body)
    if fields is None:
        return _value(body)
    return {
        k: _loose_objects(v, _loose_group_field) if k == "groups" else _value(v)
        for k, v in fields.items()
    }


def _loose_objects(raw: Raw, read_field: Callable[[str, Raw], Any]) -> Any:
    """An array of objects (the groups, a group's rollouts), each object's fields read by
    ``read_field(name, raw)``; a value that is not an array, or an element that is not an
    object, as ``json`` reads it."""
    items = _array_items(raw)
    if items is None:
        return _value(raw)
    out: list[Any] = []
    for item in items:
        fields = _object(item)
        out.append(
            _value(item) if fields is None else {k: read_field(k, v) for k, v in fields.items()}
        )
    return out


def _loose_group_field(name: str, raw: Raw) -> Any:
    return _loose_objects(raw, _loose_rollout_field) if name == "rollouts" else _value(raw)


def _loose_rollout_field(name: str, raw: Raw) -> Any:
    if name in _PER_TOKEN:
        return _array(raw, integers_only=name == "tokens")
    if name == "teacher_logprobs":
        conditions = _object(raw)
        if conditions is not None:
            return {k: _array(v, integers_only=False) for k, v in conditions.items()}
    return _value(raw)


def _object(raw: bytes | Raw) -> dict[str, Raw] | None:
    """An object's fields, raw (None: not an object)."""
    try:
        return _FIELDS.decode(raw)
    except msgspec.ValidationError:
        return None


def _array_items(raw: Raw) -> list[Raw] | None:
    """An array's elements, raw (None: not an array)."""
    try:
        return _ITEMS.decode(raw)
    except msgspec.ValidationError:
        return None


def _value(raw: bytes | Raw) -> Any:
    """A value as ``json`` reads it (a small one: the guard bounds what is not an array of
    numbers): by msgspec, or by json where msgspec refuses it (1e999, text that is not text)."""
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return loads(bytes(raw))


def _array(raw: Raw, integers_only: bool) -> Any:
    """A per-token array: numpy when numpy holds it exactly, else json's value (msgspec has
    checked that it is JSON). Integers only: int64, read by :func:`_read_integers` (half the
    time numpy's ``fromstring`` and the checks of its text took), unless one has 19 digits or
    more. Floats: msgspec's, one array's worth of Python floats at a time (numpy reads float
    text ~4x slower). ``integers_only``: token ids, where an array with anything but integers
    is json's list (its error names the element; 2.0 is no token id)."""
    view = memoryview(raw)
    if not view or view[0] != ord("["):
        return _value(raw)
    values, status = _integer_reader()(np.frombuffer(view, np.uint8))
    if status == _TOO_LONG:
        return _value(raw)
    if status != _NOT_INTEGERS:
        return values
    if integers_only:
        return _value(raw)
    try:
        return np.array(_FLOATS.decode(raw), dtype=np.float64)
    except msgspec.ValidationError:  # (not numbers only, or beyond float64: 1e999)
        return _value(raw)


def _read_integers(text: np.ndarray) -> tuple[np.ndarray, int]:
    """(values, status) of a JSON array's text (uint8, brackets included) when it holds
    integers below 10**18 in magnitude only: int64, the numbers' decimal text exactly (the
    JSON grammar already checked: no leading zeros, no sign but a leading minus). Else an empty
    array and :data:`_NOT_INTEGERS` or :data:`_TOO_LONG`. Compiled (:func:`_integer_reader`):
    one pass counts the commas, one parses (the most frequent bytes tested first)."""
    commas = 0
    for i in range(1, text.shape[0] - 1):
        commas += text[i] == 0x2C
    out = np.empty(commas + 1, np.int64)
    n = 0
    value = 0
    negative = False
    digits = False
    for i in range(1, text.shape[0] - 1):
        d = int(text[i]) - 0x30  # (a digit's value; any other byte falls outside 0-9)
        if 0 <= d <= 9:
            if value >= _INT64_EXACT // 10:  # (a 19th digit: checked before it could overflow)
                return np.empty(0, np.int64), _TOO_LONG
            value = value * 10 + d
            digits = True
        elif d == _COMMA:
            out[n] = -value if negative else value
            n += 1
            value = 0
            negative = False
        elif d == _MINUS:
            negative = True
        elif d not in _BLANKS:
            return np.empty(0, np.int64), _NOT_INTEGERS
    if not digits:
        return np.empty(0, np.int64), 0
    out[n] = -value if negative else value
    return out, 0


@functools.cache
def _integer_reader() -> Any:
    """:func:`_read_integers` compiled (numba, imported on first use as for the estimators'
    loops; cached on disk where a writable place exists). :func:`compile_readers` builds it
    before the service reports ready."""
    import numba

    try:
        return numba.njit(cache=True, nogil=True)(_read_integers)
    except RuntimeError:  # no cache location (a read-only install, no writable home)
        return numba.njit(nogil=True)(_read_integers)


def compile_readers() -> None:
    """Compile (or load from numba's cache) the per-token array reader, so that the first
    request does not wait for the compiler."""
    _integer_reader()(np.frombuffer(b"[1]", np.uint8))


def _marked(body: bytes) -> tuple[bytes, dict[str, Any], str]:
    """``body`` with each NaN, Infinity and -Infinity and each string that is not text (bytes
    that are not UTF-8, decoded with ``surrogateescape`` as :func:`loads` does; a lone surrogate
    escape) replaced by a marker string msgspec reads; the markers' values; their prefix. The
    markers carry a per-call nonce: no string a client sends can be one."""
    if _UNUSUAL.search(body) is None:
        return body, {}, ""
    nonce = secrets.token_hex(8)
    prefix = "\x01" + nonce
    literals: dict[str, Any] = {}
    out = bytearray()
    copied = pos = 0
    while (match := _LEXEME.search(body, pos)) is not None:
        start, pos = match.span()
        lexeme = match.group()
        if lexeme == b'"':  # (a string longer than a bounded match, or unterminated)
            pos = string_end(body, start)
            if pos < 0:
                break
            lexeme = body[start:pos]
        if lexeme[0] == ord('"'):
            if lexeme.isascii() and _SURROGATE_ESCAPE.search(lexeme) is None:
                continue
            value: Any = _bad_text(lexeme)
            if value is None:
                continue
        else:
            value = float(lexeme)
        out += body[copied:start]
        out += b'"\\u0001%s%d"' % (nonce.encode(), len(literals))
        literals[f"{prefix}{len(literals)}"] = value
        copied = pos
    out += body[copied:]
    return bytes(out), literals, prefix


def _bad_text(lexeme: bytes) -> str | None:
    """The value of a JSON string that is not text (None: it is, or it is no JSON string)."""
    try:
        value = json.loads(lexeme.decode("utf-8", "surrogateescape"))
    except ValueError:
        return None
    return None if not isinstance(value, str) or is_text(value) else value


def _restored(value: Any, literals: dict[str, Any], prefix: str) -> Any:
    """``value`` with the markers of :func:`_marked` replaced by what they stand for."""
    if isinstance(value, str):
        return literals.get(value, value) if value.startswith(prefix) else value
    if isinstance(value, list):
        return [_restored(item, literals, prefix) for item in value]
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            name = _restored(key, literals, prefix)
            if not isinstance(name, str):  # (NaN where a key is: json refuses it)
                raise json_limits.not_json("a key is NaN")
            out[name] = _restored(item, literals, prefix)
        return out
    return value
