"""A validated Arrow request table as the flat batch (:mod:`.arrow`): groups numbered by first
appearance from each batch's distinct ids, the rewards, the list columns' offsets and values
(the flat batch's buffers, wrapped without a copy) and the optional prompt keys. Errors name
the column and the row (by its group and rollout where the group is known).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from advantage_contract.arrow import PROMPT_KEY_COLUMN, TEACHER_PREFIX
from advantage_contract.errors import AdvantageError
from advantage_contract.fields import EXACT_INTEGER_LIMIT
from advantage_contract.flat import MAX_GROUP_ID_LENGTH, group_prompt_keys, prompt_ids

from ..batch import TOKEN_INPUTS, RolloutBatch
from ..errors import LimitExceeded, RequestError


class _Rows:
    """Locates a row for error messages: its group id and its index within the group."""

    def __init__(self, group_ids: list[str], group_index: np.ndarray) -> None:
        self.group_ids = group_ids
        self.group_index = group_index

    def where(self, row: int) -> dict[str, Any]:
        g = int(self.group_index[row])
        rank = int(np.count_nonzero(self.group_index[:row] == g))
        return {"group_id": self.group_ids[g], "rollout_index": rank}


def _column(table: pa.Table, name: str) -> pa.Array:
    column = table.column(name)
    if column.num_chunks == 1:
        return column.chunk(0)
    return column.combine_chunks()


def _first(mask: pa.Array | np.ndarray) -> int:
    values = mask.to_numpy(zero_copy_only=False) if isinstance(mask, pa.Array) else mask
    return int(np.flatnonzero(values)[0])


def _group_column(table: pa.Table) -> tuple[list[str], np.ndarray]:
    """(group ids in order of first appearance, each row's group number).

    Works from each batch's distinct ids (a dictionary's entries the rows use, or a plain
    column's distinct values): never one string per row, so a dictionary of one long id
    referenced by every row costs its bytes once. Ids are checked against the JSON limit
    before they become Python strings."""
    entries: list[pa.Array] = []
    codes: list[np.ndarray] = []
    row0 = base = 0
    for chunk in table.column("group_id").chunks:
        if pa.types.is_dictionary(chunk.type):
            indices, dictionary = chunk.indices, chunk.dictionary
        else:
            encoded = pc.dictionary_encode(chunk)
            indices, dictionary = encoded.indices, encoded.dictionary
        if indices.null_count:
            row = row0 + _first(indices.is_null())
            raise RequestError("invalid_type", f"group_id of row {row} is null", field="group_id")
        index = indices.to_numpy(zero_copy_only=False).astype(np.int64)
        used, inverse = np.unique(index, return_inverse=True)
        picked = dictionary.take(pa.array(used))
        if picked.null_count:
            entry = _first(picked.is_null())
            row = row0 + int(np.flatnonzero(inverse == entry)[0])
            raise RequestError("invalid_type", f"group_id of row {row} is null", field="group_id")
        entries.append(picked)
        codes.append(inverse.reshape(-1) + base)
        base += len(picked)
        row0 += len(chunk)
    if not entries:
        return [], np.zeros(0, np.int64)
    distinct = pc.dictionary_encode(pa.concat_arrays(entries))
    row_codes = distinct.indices.to_numpy(zero_copy_only=False).astype(np.int64)[
        np.concatenate(codes)
    ]
    lengths = pc.utf8_length(distinct.dictionary).to_numpy(zero_copy_only=False)
    too_long = np.flatnonzero(lengths > MAX_GROUP_ID_LENGTH)
    if too_long.size:
        entry = int(too_long[0])
        row = int(np.flatnonzero(row_codes == entry)[0])
        # (not echoed: it is too long to be an id)
        raise LimitExceeded(
            f"group_id of row {row} has {int(lengths[entry])} characters; the limit is "
            f"{MAX_GROUP_ID_LENGTH}",
            field="group_id",
        )
    empty = np.flatnonzero(lengths == 0)
    if empty.size:  # (refused on every transport alike: streams key groups by their id)
        row = int(np.flatnonzero(row_codes == int(empty[0]))[0])
        raise RequestError(
            "invalid_value",
            f"group_id of row {row} is empty: a group id is a non-empty string",
            field="group_id",
        )
    # Number groups by first appearance.
    present, first = np.unique(row_codes, return_index=True)
    order = present[np.argsort(first)]
    rank = np.empty(len(distinct.dictionary), np.int64)
    rank[order] = np.arange(len(order))
    return distinct.dictionary.take(pa.array(order)).to_pylist(), rank[row_codes]


def _rewards(table: pa.Table, rows: _Rows) -> np.ndarray:
    reward = _column(table, "reward")
    if reward.null_count:
        row = _first(reward.is_null())
        raise RequestError("invalid_type", "reward is null", field="reward", **rows.where(row))
    if pa.types.is_int64(reward.type) or pa.types.is_uint64(reward.type):
        values = reward.to_numpy(zero_copy_only=False)
        inexact = values > EXACT_INTEGER_LIMIT
        if pa.types.is_int64(reward.type):
            inexact |= values < -EXACT_INTEGER_LIMIT
        if inexact.any():
            row = _first(inexact)
            raise RequestError(
                "out_of_range",
                f"reward {int(values[row])} is an integer a float64 cannot hold exactly "
                f"(beyond +-2^53); send it as a float",
                field="reward",
                **rows.where(row),
            )
    return reward.cast(pa.float64()).to_numpy(zero_copy_only=False)


def _list_column(
    table: pa.Table, name: str, rows: _Rows, integer: bool
) -> tuple[np.ndarray, np.ndarray] | None:
    """(offsets int64 (B+1,) from 0, values (N,)) of a validated list column; None when it is
    all null (or of the null type).

    A null row (given for some rollouts, not this one) and a null value are request errors.
    The first offset need not be 0 (a slice of a longer array): only the values between the
    first and the last offset are read.
    """
    column = _column(table, name)
    if pa.types.is_null(column.type) or (column.null_count == len(column) and len(column)):
        return None
    value_type = column.type.value_type
    if column.null_count:
        row = _first(column.is_null())
        raise RequestError(
            "missing_input",
            f"{name} is given for some rollouts but not this one; give it for every rollout "
            "or none",
            field=name,
            **rows.where(row),
        )
    offsets = column.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    start, end = int(offsets[0]), int(offsets[-1])
    values = column.values.slice(start, end - start)
    offsets -= start
    if values.null_count:
        position = _first(values.is_null())
        row = int(np.searchsorted(offsets, position, side="right")) - 1
        raise RequestError(
            "invalid_type",
            f"{name}[{position - int(offsets[row])}] is null",
            field=name,
            **rows.where(row),
        )
    if integer and not (pa.types.is_int32(value_type) or pa.types.is_int64(value_type)):
        try:
            values = values.cast(pa.int64())
        except pa.ArrowInvalid as exc:
            raise RequestError(
                "token_out_of_range", f"{name} holds an id out of range: {exc}", field=name
            ) from exc
    if pa.types.is_float16(value_type):
        values = values.cast(pa.float32())
    return offsets, values.to_numpy(zero_copy_only=False)


def batch_from_valid(table: pa.Table, vocab_size: int | None) -> RolloutBatch:
    """:func:`.arrow.batch_from_table` of a table whose schema passed :func:`.arrow._plan` and
    whose every batch passed :func:`.arrow._validate`."""
    names = table.column_names
    group_ids, group_index = _group_column(table)
    rows = _Rows(group_ids, group_index)
    rewards = _rewards(table, rows)

    tokens = _list_column(table, "tokens", rows, integer=True)
    if tokens is None:
        row = 0
        raise RequestError(
            "invalid_type", "tokens must be a list of token ids", field="tokens", **rows.where(row)
        )
    offsets, token_values = tokens
    lengths = np.diff(offsets)

    def per_token(name: str, field: str) -> np.ndarray | None:
        out = _list_column(table, name, rows, integer=False)
        if out is None:
            return None
        their_offsets, values = out
        mismatch = np.flatnonzero(np.diff(their_offsets) != lengths)
        if mismatch.size:
            row = int(mismatch[0])
            raise RequestError(
                "length_mismatch",
                f"{field} has {int(their_offsets[row + 1] - their_offsets[row])} values for "
                f"{int(lengths[row])} tokens",
                field=field,
                **rows.where(row),
            )
        return values

    token_inputs = {name: per_token(name, name) for name in TOKEN_INPUTS if name in names}
    teacher: dict[str, np.ndarray] = {}
    for name in names:
        if name.startswith(TEACHER_PREFIX):
            condition = name[len(TEACHER_PREFIX) :]
            values = per_token(name, f"teacher_logprobs.{condition}")
            if values is not None:
                teacher[condition] = values
    return RolloutBatch.from_flat(
        tokens=token_values,
        offsets=offsets,
        group_ids=group_ids,
        group_index=group_index,
        rewards=rewards,
        teacher_logprobs=teacher,
        vocab_size=vocab_size,
        prompt_ids=_prompt_ids(table, group_ids, group_index),
        **token_inputs,
    )


def _prompt_ids(table: pa.Table, group_ids: list[str], group_index: np.ndarray) -> list[str] | None:
    """Per group, the key of its history from the optional ``prompt_key`` column (a null row
    gives none; the rows of a group must agree); None without the column."""
    if PROMPT_KEY_COLUMN not in table.column_names:
        return None
    column = _column(table, PROMPT_KEY_COLUMN)
    if pa.types.is_null(column.type):
        return None
    # (lengths from the offsets, before any key becomes a Python string)
    lengths = pc.utf8_length(column).to_numpy(zero_copy_only=False)
    too_long = np.flatnonzero(np.nan_to_num(lengths.astype(np.float64)) > MAX_GROUP_ID_LENGTH)
    if too_long.size:
        row = int(too_long[0])
        raise LimitExceeded(
            f"prompt_key of row {row} has {int(lengths[row])} characters; the limit is "
            f"{MAX_GROUP_ID_LENGTH}",
            field=PROMPT_KEY_COLUMN,
        )
    try:
        keys = group_prompt_keys(column.cast(pa.string()).to_pylist(), group_ids, group_index)
    except AdvantageError as exc:
        raise RequestError.from_contract(exc) from exc
    return prompt_ids(group_ids, keys)
