"""The JSON response contract: per-rollout arrays cut from the flat result, plus a summary."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..estimators import AdvantageResult
from .request import ComputeRequest


def split_per_rollout(values: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    """Views of ``values`` (N,) for each rollout, by ``offsets`` (B+1,)."""
    return np.split(values, offsets[1:-1]) if offsets.size > 1 else []


def build_response(
    req: ComputeRequest, result: AdvantageResult, summary: dict[str, Any]
) -> dict[str, Any]:
    """The response object with numpy float32 arrays (the JSON transport lists them)."""
    batch = req.batch
    offsets = batch.offsets.cpu().numpy()
    columns: dict[str, list[Any]] = {
        "advantages": split_per_rollout(result.advantages.cpu().numpy(), offsets)
    }
    for name in req.returns:
        if name == "scalar":
            # (numpy float32 scalars: JSON prints their shortest float32 repr, as for arrays)
            columns["scalar"] = list(result.scalars.cpu().numpy())
        else:
            columns[name] = split_per_rollout(result.diagnostics[name].cpu().numpy(), offsets)
    rows = [
        dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)
    ]
    # Rollouts in group order: the rows of a group need not be adjacent (an Arrow table, a
    # padded batch), and within a group they keep the order they came in.
    group_index = batch.group_index.cpu().numpy()
    order = np.argsort(group_index, kind="stable")
    sizes = batch.group_sizes.cpu().tolist()
    # Per group, what its history read gave (when the request reads history): on the group.
    summary = dict(summary)
    per_group = summary.pop("group_history", None)
    groups = []
    start = 0
    for g, (gid, size) in enumerate(zip(batch.group_ids, sizes, strict=True)):
        group: dict[str, Any] = {
            "id": gid,
            "rollouts": [rows[i] for i in order[start : start + size]],
        }
        if per_group is not None:
            group["history"] = per_group[g]
        groups.append(group)
        start += size
    return {
        "request_id": req.request_id,
        "namespace": req.namespace,
        "estimator": req.estimator.to_dict(),
        "groups": groups,
        "summary": summary,
    }
