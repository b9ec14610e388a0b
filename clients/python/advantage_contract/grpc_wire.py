"""The gRPC wire beside the generated messages: the tensor dtypes and the trailing metadata
keys of an error (``proto/advantage/v1/advantage.proto``'s header comment), read by the service's
codec and the client alike."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import numpy as np

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
