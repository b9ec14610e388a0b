"""Structured logs: one JSON object per line (``ADV_LOG_FORMAT=json``) or text for a terminal.

Every request answered by the service writes one line on the logger ``advantage_service.access``
(:func:`access`), with the fields of :data:`ACCESS_FIELDS`. Nothing here ever sees a token or
an ``Authorization`` value: the callers pass named fields only.

A line is never lost to what it holds: a string that is not text (a lone surrogate, which no
UTF-8 writer takes: the request decoders refuse such strings, but a log line may repeat what a
client sent before that) is written with it escaped (``\\ud800``), and a value JSON cannot
hold as is, as its ``str``.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

from ..errors import escaped

ACCESS_LOGGER = "advantage_service.access"
access_log = logging.getLogger(ACCESS_LOGGER)

# The fields of an access line, in this order (None where they do not apply).
ACCESS_FIELDS = (
    "request_id",
    "namespace",
    "principal",
    "transport",
    "estimator",
    "groups",
    "rollouts",
    "tokens",
    "history",
    "compute_ms",
    "total_ms",
    "status",
    "error",
)


class JsonFormatter(logging.Formatter):
    """``{"time", "level", "logger", "message", ...fields}`` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        try:
            return orjson.dumps(out, default=str).decode()
        except orjson.JSONEncodeError:  # (rare: the walk is paid only then)
            return orjson.dumps(loggable(out)).decode()


def loggable(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON takes it whatever it holds: strings (keys included) with lone
    surrogates escaped, integers beyond 64 bits and other objects as their (escaped) ``str``."""
    if value is None or isinstance(value, bool | float):
        return value
    if isinstance(value, int):
        return value if -(2**63) <= value < 2**64 else str(value)
    if isinstance(value, str):
        return escaped(value)
    if depth < 8 and isinstance(value, dict):
        return {escaped(str(k)): loggable(v, depth + 1) for k, v in value.items()}
    if depth < 8 and isinstance(value, list | tuple):
        return [loggable(v, depth + 1) for v in value]
    return escaped(str(value))


class TextFormatter(logging.Formatter):
    """The usual text line, with an access line's fields as ``key=value`` after the message."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line += " " + " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        return escaped(line)  # (a stream that encodes strictly would drop the line otherwise)


# What gRPC's core logs at ERROR, with a traceback, for what a client does and the service
# answers as it should: a metadata value that is not UTF-8 (twice per call, the call served),
# and a stream's answer written after its client cancelled. Any client could fill the log with
# them and hide the errors that matter; at DEBUG they are still written.
CLIENT_NOISE_LOGGER = "grpc._cython.cygrpc"
CLIENT_NOISE = ("Invalid encoding on ", "ExecuteBatchError raised in core by servicer method")


class ClientNoise(logging.Filter):
    """Lets gRPC core's records of :data:`CLIENT_NOISE` through only at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.msg if isinstance(record.msg, str) else ""
        if not message.startswith(CLIENT_NOISE):
            return True
        return logging.getLogger().isEnabledFor(logging.DEBUG)


def configure(level: str, fmt: str) -> None:
    """Send every logger (uvicorn's included) to stderr in ``fmt`` (json or text), at ``level``;
    access lines at INFO whatever ``level`` is."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    # Access lines are the record of what was served: written whatever the level of the rest.
    access_log.setLevel(logging.INFO)
    noisy = logging.getLogger(CLIENT_NOISE_LOGGER)
    if not any(isinstance(f, ClientNoise) for f in noisy.filters):
        noisy.addFilter(ClientNoise())


def access(**fields: Any) -> None:
    """One access line: ``fields`` are those of :data:`ACCESS_FIELDS` (missing ones: None)."""
    if access_log.isEnabledFor(logging.INFO):
        # (strings escaped here too, for whatever handler a deployment adds: an O(1) ASCII
        # check per field on the usual line)
        record = {
            name: escaped(value) if isinstance(value, str) else value
            for name in ACCESS_FIELDS
            for value in (fields.get(name),)
        }
        access_log.info("request", extra={"fields": record})
