"""JSON text for the contract: numpy arrays become lists, and parse errors become RequestErrors."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from .errors import RequestError


def _default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def dumps(obj: Any) -> str:
    """Compact JSON of a response (numpy arrays as lists)."""
    return json.dumps(obj, default=_default, separators=(",", ":"), allow_nan=False)


def loads(text: str | bytes) -> Any:
    """Parse request JSON; malformed text raises RequestError (code ``invalid_json``)."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(
            "invalid_json", f"request body is not valid JSON: {exc}", field=""
        ) from exc
