"""The gRPC wire beside the generated messages: the tensor dtypes and an error's trailing
metadata (``proto/advantage/v1/advantage.proto``'s header comment), written by the service's
codec and read by the client with the same keys."""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from typing import Any

import numpy as np

from .errors import AdvantageError
from .grpc_gen import advantage_pb2 as pb

# Wire dtype -> numpy dtype of a tensor's raw bytes (little-endian whatever the host).
WIRE_DTYPES: dict[pb.DType, np.dtype[Any]] = {
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_FLOAT64: np.dtype("<f8"),
}
# Native numpy dtype -> wire dtype (an array of another dtype goes as the nearest of these).
DTYPE_OF: dict[np.dtype[Any], pb.DType] = {
    dtype.newbyteorder("="): wire for wire, dtype in WIRE_DTYPES.items()
}

# Trailing metadata keys of an error (values of -bin keys are UTF-8 bytes).
ERROR_CODE_KEY = "advantage-error-code"
GROUP_ID_KEY = "advantage-group-id-bin"
ROLLOUT_INDEX_KEY = "advantage-rollout-index"
FIELD_KEY = "advantage-field-bin"
# An overload's retry hint: whole seconds, and milliseconds.
RETRY_AFTER_KEY = "retry-after"
RETRY_AFTER_MS_KEY = "retry-after-ms"

Metadata = tuple[tuple[str, str | bytes], ...]


def error_metadata(
    error: AdvantageError,
    retry_after_seconds: int | None = None,
    retry_after_ms: int | None = None,
) -> Metadata:
    """Trailing metadata locating ``error``, with an overload's retry hint (whole seconds and
    milliseconds) where it has one."""
    metadata: list[tuple[str, str | bytes]] = [(ERROR_CODE_KEY, error.code)]
    if error.group_id is not None:
        metadata.append((GROUP_ID_KEY, str(error.group_id).encode()))
    if error.rollout_index is not None:
        metadata.append((ROLLOUT_INDEX_KEY, str(error.rollout_index)))
    if error.field is not None:
        metadata.append((FIELD_KEY, str(error.field).encode()))
    if retry_after_seconds is not None:
        metadata.append((RETRY_AFTER_KEY, str(retry_after_seconds)))
    if retry_after_ms is not None:
        metadata.append((RETRY_AFTER_MS_KEY, str(retry_after_ms)))
    return tuple(metadata)


def _whole(value: Any) -> int | None:
    """A metadata value that is a whole non-negative number, else None."""
    text = str(value).strip() if value is not None else ""
    return int(text) if text.isdigit() else None


def error_from_metadata(
    status: str, details: str | None, metadata: Iterable[tuple[str, str | bytes]]
) -> AdvantageError:
    """The service's error from a call's status code name (``INVALID_ARGUMENT``), details and
    trailing metadata, with its retry hints: ``retry-after`` (seconds) and ``retry-after-ms``."""
    meta: dict[str, Any] = {}
    for key, value in metadata:
        meta[key] = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    index = meta.get(ROLLOUT_INDEX_KEY)
    retry_after = _whole(meta.get(RETRY_AFTER_KEY))
    return AdvantageError(
        meta.get(ERROR_CODE_KEY) or status.lower(),
        details or status,
        group_id=meta.get(GROUP_ID_KEY),
        rollout_index=int(index) if index is not None else None,
        field=meta.get(FIELD_KEY),
        grpc_code=status,
        retry_after=float(retry_after) if retry_after is not None else None,
        retry_after_ms=_whole(meta.get(RETRY_AFTER_MS_KEY)),
    )


def drop_failed(failed: MutableMapping[str, int], group_id: str) -> bool:
    """Whether a streamed rollout is one of the rest of a group already answered with an error
    (``failed``: such groups -> their rollouts still expected), which both ends drop: counted
    down here, the group forgotten with its last one."""
    remaining = failed.get(group_id)
    if remaining is None:
        return False
    if remaining <= 1:
        del failed[group_id]
    else:
        failed[group_id] = remaining - 1
    return True
