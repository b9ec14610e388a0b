"""The Arrow IPC wire of ``POST /v1/advantages``: its media type, metadata keys, column names,
and the one encoder of a request (the clients' and the service's test and benchmark tools).

A request is one Arrow table, one row per rollout in the flat layout's order: ``group_id``
(string), ``reward`` (float64: an integer reward up to 2**53 travels exact, as in JSON),
``tokens`` (list of int32 or int64), optional ``prompt_key`` (string, the same on every row of a
group), each per-token input of :data:`~.fields.TOKEN_FIELDS` and ``teacher.<condition>`` (list
of float32, offsets shared with ``tokens``), each reward component as ``component.<name>``
(float64, null where the rollout has no value; ``reward`` is then null where the rollout gave
none); the options (the JSON request without ``groups``) as
JSON in the schema metadata under ``advantage.request``. The answer's metadata is under
``advantage.response``. The service decodes it (with its bounds) in its own transport.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

MEDIA_TYPE = "application/vnd.apache.arrow.stream"
REQUEST_METADATA = b"advantage.request"
RESPONSE_METADATA = b"advantage.response"
TEACHER_PREFIX = "teacher."
COMPONENT_PREFIX = "component."
REQUIRED_COLUMNS = ("group_id", "reward", "tokens")
PROMPT_KEY_COLUMN = "prompt_key"


def request_table(
    *,
    group_ids: Sequence[str],
    group_index: np.ndarray,
    offsets: np.ndarray,
    tokens: np.ndarray,
    rewards: np.ndarray,
    per_token: Mapping[str, np.ndarray],
    teacher_logprobs: Mapping[str, np.ndarray],
    prompt_keys: Sequence[str | None] | None = None,
    options_json: str | bytes | None = None,
    reward_components: Mapping[str, np.ndarray] | None = None,
) -> Any:
    """The request table of a flat batch: ``group_index`` (B,) into ``group_ids``, ``offsets``
    (B+1,), ``tokens`` (N,), ``rewards`` (B,), per-token arrays (N,) by name, ``prompt_keys``
    one per group (None: none); ``options_json``
    the options already written as JSON (None: none); ``reward_components`` name -> (B,), NaN
    where a rollout has no value (then a NaN reward is none: null)."""
    import pyarrow as pa

    offset_array = pa.array(np.asarray(offsets).astype(np.int32), type=pa.int32())

    def lists(values: np.ndarray, kind: Any) -> Any:
        return pa.ListArray.from_arrays(offset_array, pa.array(values, type=kind))

    tokens_type = pa.int32() if tokens.dtype == np.int32 else pa.int64()
    index = pa.array(group_index)
    columns: dict[str, Any] = {
        "group_id": pa.array(list(group_ids), type=pa.string()).take(index),
        "reward": _numbers(rewards, bool(reward_components)),
        "tokens": lists(tokens, tokens_type),
    }
    if prompt_keys is not None:  # (per group, spread to its rows as the group ids are)
        columns[PROMPT_KEY_COLUMN] = pa.array(list(prompt_keys), type=pa.string()).take(index)
    for name, values in per_token.items():
        columns[name] = lists(values, pa.float32())
    for name, values in teacher_logprobs.items():
        columns[TEACHER_PREFIX + name] = lists(values, pa.float32())
    for name, values in (reward_components or {}).items():
        columns[COMPONENT_PREFIX + name] = _numbers(values, True)
    table = pa.table(columns)
    if options_json is not None:
        table = table.replace_schema_metadata({REQUEST_METADATA: options_json})
    return table


def _numbers(values: np.ndarray, nulls: bool) -> Any:
    """A float64 column of ``values`` (B,); with ``nulls``, NaN travels as null (none)."""
    import pyarrow as pa

    array = np.asarray(values, dtype=np.float64)
    mask = np.isnan(array) if nulls else None
    return pa.array(array, type=pa.float64(), mask=mask)


def stream_bytes(table: Any) -> bytes:
    """``table`` as an Arrow IPC stream."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())
