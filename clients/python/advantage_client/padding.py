"""Results in the (batch, max_len) padded layout trainers use."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np


def result_rollouts(results: Any) -> list[Mapping[str, Any]]:
    """Every rollout of a response dict (``{"groups": [...]}``), a list of group results
    (``{"id", "rollouts"}``, from :meth:`GrpcClient.stream`) or a list of rollout dicts, in
    order: groups as given, rollouts within each group in order. Group errors (a result with
    ``"error"``) have no rollouts."""
    if isinstance(results, Mapping):
        if "groups" in results:
            results = results["groups"]
        elif "rollouts" in results:
            results = [results]
        else:
            raise ValueError("expected a response ({'groups': ...}) or a group ({'rollouts': ...})")
    rollouts: list[Mapping[str, Any]] = []
    for item in results:
        if "rollouts" in item:
            rollouts.extend(item["rollouts"])
        elif "error" in item:
            continue
        else:
            rollouts.append(item)
    return rollouts


def to_padded(
    results: Any,
    *,
    key: str = "advantages",
    max_len: int | None = None,
    pad_value: float = 0.0,
    order: Sequence[str] | None = None,
    dtype: Any = np.float32,
    mask: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(values, mask)``: per-token ``key`` of every rollout as a (batch, max_len) array, right
    padded with ``pad_value``, and the bool mask of real tokens.

    ``mask`` (the trainer's (batch, T) mask, left padding or holes allowed): each rollout's
    values go to its row's true positions, in order (row i must have as many as rollout i has
    values), and the mask returned is that one; ``max_len`` does not apply.

    Rows follow :func:`result_rollouts` (request order for a response dict) or ``order``, a
    list of ``rollout_id`` values (stream results arrive in completion order; ``order`` puts
    them back in the trainer's). ``max_len`` (default: the longest rollout) must be at least
    every rollout's length: the trainer's response length, so that the array lines up with its
    own (batch, response_length) tensors.
    """
    rollouts = result_rollouts(results)
    if order is not None:
        by_id: dict[Any, Mapping[str, Any]] = {}
        for r in rollouts:
            rid = r.get("rollout_id")
            if rid in by_id:
                raise ValueError(f"rollout_id {rid!r} appears twice in the results")
            by_id[rid] = r
        missing = [rid for rid in order if rid not in by_id]
        if missing:
            raise KeyError(f"no result for rollout ids {missing[:5]}")
        rollouts = [by_id[rid] for rid in order]
    arrays = [np.asarray(r[key]) for r in rollouts]
    if mask is not None:
        return scatter_to_mask(arrays, mask, pad_value=pad_value, dtype=dtype)
    return pad_arrays(arrays, max_len=max_len, pad_value=pad_value, dtype=dtype)


def scatter_to_mask(
    arrays: Iterable[np.ndarray], mask: Any, *, pad_value: float = 0.0, dtype: Any = np.float32
) -> tuple[np.ndarray, np.ndarray]:
    """Ragged 1-D arrays placed at the true positions of ``mask`` (B, T), row i's in order:
    ``(values, mask)``, one scatter (no per-row copy loop)."""
    from advantage_contract.padded import as_numpy

    m = as_numpy(mask, "mask")
    m = m if m.dtype == np.bool_ else m != 0
    arrays = list(arrays)
    if m.ndim != 2 or m.shape[0] != len(arrays):
        raise ValueError(f"mask must be ({len(arrays)}, T), got shape {m.shape}")
    lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    counts = np.count_nonzero(m, axis=1)
    wrong = np.flatnonzero(counts != lengths)
    if wrong.size:
        row = int(wrong[0])
        raise ValueError(
            f"rollout {row} has {int(lengths[row])} values; its mask row has {int(counts[row])}"
        )
    values = np.full(m.shape, pad_value, dtype=dtype)
    if lengths.sum():
        values[m] = np.concatenate(arrays)
    return values, m


def pad_arrays(
    arrays: Iterable[np.ndarray],
    *,
    max_len: int | None = None,
    pad_value: float = 0.0,
    dtype: Any = np.float32,
) -> tuple[np.ndarray, np.ndarray]:
    """Ragged 1-D arrays as a right-padded (len(arrays), max_len) array and its mask, filled
    with one scatter (no per-row copy loop)."""
    arrays = list(arrays)
    lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    longest = int(lengths.max()) if lengths.size else 0
    width = longest if max_len is None else int(max_len)
    if width < longest:
        row = int(np.argmax(lengths))
        raise ValueError(f"rollout {row} has {longest} tokens, more than max_len={width}")
    values = np.full((len(arrays), width), pad_value, dtype=dtype)
    mask = np.zeros((len(arrays), width), dtype=bool)
    if lengths.sum():
        flat = np.concatenate(arrays)
        rows = np.repeat(np.arange(len(arrays)), lengths)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        cols = np.arange(flat.size) - np.repeat(starts, lengths)
        values[rows, cols] = flat
        mask[rows, cols] = True
    return values, mask
