"""Text is valid Unicode or refused: every string of a request (ids, names, keys, values) must
encode as UTF-8, on every transport.

A Python str can hold what UTF-8 cannot: a lone surrogate, from JSON's ``"\\ud800"`` escape (which
``json`` accepts) or from bytes that are not UTF-8 decoded with ``surrogateescape`` (as
:func:`~advantage_service.wire.jsonio.loads` decodes them, so that the field holding them can
be named). Such a string fails wherever it is encoded: the JSON answer, a protobuf field, a
Redis key, a log line. So it is refused where the request is decoded, before anything keeps or
repeats it: a 422 ``invalid_text`` (gRPC INVALID_ARGUMENT) whose ``field`` is the JSON path of
the string (``request_id``, ``groups[3].id``, ``estimator.outcome.name``; a key is named by its
own path, escaped: ``groups[0].rollouts[1].teacher_logprobs.\\ud800``).

The check costs nothing in proportion to a request's size where its text is ASCII (CPython
flags an ASCII str: :func:`~advantage_service.errors.is_text` is O(1) then), and one join of
the group ids otherwise; the walk that finds the path runs only once something is known to be
wrong.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import unquote_to_bytes

from ..errors import RequestError, escaped, is_text

INVALID_TEXT = "invalid_text"


def _what(value: str) -> str:
    """Where ``value`` stops being text, for an error message."""
    for i, char in enumerate(value):
        if "\ud800" <= char <= "\udfff":
            why = "a lone surrogate (a \\ud800-\\udfff escape must be half of a pair)"
            if "\udc80" <= char <= "\udcff":  # (how surrogateescape writes a byte)
                why = f"a lone surrogate, or the byte 0x{ord(char) - 0xDC00:02x} that is not UTF-8"
            return f"character {i} is {escaped(char)}, {why}"
    return "it does not encode as UTF-8"


def invalid_text(
    field: str, value: str | None = None, is_key: bool = False, **where: Any
) -> RequestError:
    """The refusal of the string ``value`` at ``field`` (a JSON path; ``is_key``: the string
    is the name of the field at that path)."""
    what = f"the name of field {field}" if is_key else field
    detail = f": {_what(value)}" if value is not None else ""
    return RequestError(
        INVALID_TEXT,
        f"{what} is not valid UTF-8 text{detail}; every string of a request must be",
        field=field,
        **where,
    )


def check_text(value: str, field: str, **where: Any) -> None:
    """Refuse ``value`` unless it is text (422 ``invalid_text`` naming ``field``)."""
    if not is_text(value):
        raise invalid_text(field, value, **where)


def all_text(values: Iterable[str]) -> bool:
    """Whether every string of ``values`` is text: one join, then one flag read when they
    are all ASCII (131,072 group ids: about 0.3 ms)."""
    return is_text("".join(values))


def _key(path: str, key: str) -> str:
    return f"{path}.{escaped(key)}" if path else escaped(key)


def first_invalid(
    tree: Any, path: str = "", skip: Iterable[str] = ()
) -> tuple[str, str, bool] | None:
    """(JSON path, the string, whether it is a key) of the first key or string in ``tree``
    (dicts, lists and tuples of JSON values; anything else, numpy arrays among them, holds no
    text to check) that is not text; None when all are. ``skip``: keys of the top-level object
    not to look into."""
    skipped = frozenset(skip)
    stack: list[tuple[Any, str]] = [(tree, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, str):
            if not is_text(node):
                return where, node, False
        elif isinstance(node, Mapping):
            items = list(node.items())
            for key, _value in items:
                if isinstance(key, str) and not is_text(key):
                    return _key(where, key), key, True
            stack.extend(
                (value, _key(where, str(key)))
                for key, value in reversed(items)
                if isinstance(value, str | Mapping | list | tuple)
                and not (node is tree and key in skipped)
            )
        elif isinstance(node, list | tuple):
            stack.extend(
                (value, f"{where}[{i}]")
                for i, value in reversed(list(enumerate(node)))
                if isinstance(value, str | Mapping | list | tuple)
            )
    return None


def check_tree(tree: Any, path: str = "", skip: Iterable[str] = ()) -> None:
    """Refuse the first string of ``tree`` (keys included) that is not text, naming its
    JSON path (see :func:`first_invalid`)."""
    found = first_invalid(tree, path, skip)
    if found is not None:
        raise invalid_text(*found)


def invalid_utf8(exc: UnicodeDecodeError, field: str, what: str | None = None) -> RequestError:
    """The refusal of bytes that ``exc`` found not UTF-8, at ``field`` (``what``: how the
    message calls it, ``field`` by default)."""
    bad = bytes(exc.object[exc.start : max(exc.end, exc.start + 4)])
    return RequestError(
        INVALID_TEXT,
        f"{what or field} is not valid UTF-8 text: the bytes at {exc.start} ({bad!r}) are not "
        f"UTF-8 ({exc.reason}); every string of a request must be",
        field=field,
    )


def check_utf8(data: bytes, field: str, what: str | None = None) -> str:
    """``data`` decoded as UTF-8; refused (naming ``field``) when it is not UTF-8 (lone
    surrogates, encoded, are not)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid_utf8(exc, field, what) from None


def check_query(raw: bytes) -> None:
    """Every name and value of a URL's query string (its raw bytes, as the server received
    them) UTF-8 once percent-decoded. The framework decodes what is not into U+FFFD: a
    namespace would silently become another one."""
    if raw.isascii() and b"%" not in raw:
        return  # (nothing percent-encoded: ASCII, text)
    for pair in raw.split(b"&"):
        name, _, value = pair.partition(b"=")
        decoded_name = unquote_to_bytes(name.replace(b"+", b" "))
        field = check_utf8(decoded_name, "query", "a query parameter's name")
        check_utf8(unquote_to_bytes(value.replace(b"+", b" ")), field, f"query parameter {field}")


def check_path_segment(raw_path: bytes, field: str) -> None:
    """The last segment of a URL's raw path (a path parameter such as a request id) UTF-8
    once percent-decoded."""
    segment = raw_path.rstrip(b"/").rpartition(b"/")[2]
    if segment.isascii() and b"%" not in segment:
        return
    check_utf8(unquote_to_bytes(segment), field)
