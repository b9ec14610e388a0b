"""JSON text for the contract: numpy arrays become lists, and parse errors become RequestErrors.

One float formatting everywhere (HTTP, gRPC's JSON fields, Arrow metadata, the CLI): orjson's,
each float32 value in its shortest float32 repr (``0.70710576``, not ``0.7071057558059692``) and
float64 values in their shortest repr (``1e-6``).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import orjson

from .errors import RequestError


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
        raise RequestError(
            "invalid_json", f"request body is not valid JSON: {exc}", field=""
        ) from exc
