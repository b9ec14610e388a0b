"""The Arrow response (:mod:`.arrow`): one row per rollout, in request order, with ``group_id``,
``rollout_index``, ``advantages`` list<float32>, ``scalar`` float32 and each requested per-token
diagnostic, the rest as JSON in the schema metadata key ``advantage.response``; and the client
side's helpers that tests, benchmarks and embedding trainers use: a flat batch as a request
table, and a response body read back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
from advantage_contract import arrow as contract_arrow
from advantage_contract.arrow import RESPONSE_METADATA

from ..batch import RolloutBatch
from ..estimators import AdvantageResult
from ..wire import jsonio
from ..wire.request import ComputeRequest

# ---- response -----------------------------------------------------------------------------------


def _lists(offsets: pa.Array, values: np.ndarray) -> pa.Array:
    return pa.ListArray.from_arrays(offsets, pa.array(values, type=pa.float32()))


def encode_response(
    req: ComputeRequest, result: AdvantageResult, summary: dict[str, Any]
) -> pa.Buffer:
    """The response as an Arrow IPC stream (one record batch)."""
    batch = req.batch
    offsets = pa.array(batch.offsets.cpu().numpy().astype(np.int32), type=pa.int32())
    group_index = batch.group_index.cpu().numpy()
    columns: dict[str, pa.Array] = {
        "group_id": pa.array(batch.group_ids, type=pa.string()).take(pa.array(group_index)),
        "rollout_index": pa.array(batch.rank_in_group.cpu().numpy().astype(np.int32)),
        "advantages": _lists(offsets, result.advantages.cpu().numpy()),
        "scalar": pa.array(result.scalars.cpu().numpy(), type=pa.float32()),
    }
    for name in req.returns:
        if name != "scalar":
            columns[name] = _lists(offsets, result.diagnostics[name].cpu().numpy())
    meta = {
        "request_id": req.request_id,
        "namespace": req.namespace,
        "estimator": req.estimator.to_dict(),
        "summary": summary,
    }
    table = pa.table(columns).replace_schema_metadata({RESPONSE_METADATA: jsonio.dumps(meta)})
    return write_stream(table)


def write_stream(table: pa.Table) -> pa.Buffer:
    """``table`` as an Arrow IPC stream."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


# ---- client side (tests, benchmarks, embedding trainers) ---------------------------------------


def request_table(batch: RolloutBatch, options: Mapping[str, Any] | None = None) -> pa.Table:
    """A flat batch as a request table (the inverse of :func:`.arrow.batch_from_table`), with
    ``options`` (the JSON request without ``groups``) in the schema metadata: the contract's
    encoder, the same bytes a client sends."""
    table: pa.Table = contract_arrow.request_table(
        group_ids=batch.group_ids,
        group_index=batch.group_index.cpu().numpy(),
        offsets=batch.offsets.cpu().numpy(),
        tokens=batch.tokens.cpu().numpy().astype(np.int32),
        rewards=_given_rewards(batch),
        per_token={name: v.cpu().numpy() for name, v in batch.token_inputs().items()},
        teacher_logprobs={name: v.cpu().numpy() for name, v in batch.teacher_logprobs.items()},
        options_json=jsonio.dumps(dict(options)) if options else None,
        reward_components={n: v.cpu().numpy() for n, v in batch.reward_components.items()},
    )
    return table


def _given_rewards(batch: RolloutBatch) -> np.ndarray:
    """The rewards the client gave: NaN (null) where a rollout gave only components."""
    rewards = batch.rewards.cpu().numpy()
    if batch.reward_derived is None:
        return rewards
    return np.where(batch.reward_derived.cpu().numpy(), np.nan, rewards)


def read_response(body: bytes | bytearray | memoryview) -> tuple[dict[str, Any], pa.Table]:
    """(the ``advantage.response`` metadata object, the per-rollout table) of a response."""
    with pa.ipc.open_stream(pa.py_buffer(body)) as reader:
        table = reader.read_all()
    meta = jsonio.loads((table.schema.metadata or {})[RESPONSE_METADATA])
    return meta, table
