"""The padded (batch, max_len) layout helper."""

from __future__ import annotations

import numpy as np
import pytest
from advantage_client import pad_arrays, result_rollouts, to_padded


def response(*groups: list[list[float]]) -> dict:
    return {
        "groups": [
            {"id": f"g{g}", "rollouts": [{"advantages": np.asarray(r, np.float32)} for r in rows]}
            for g, rows in enumerate(groups)
        ]
    }


def test_rows_follow_request_order_right_padded_with_a_mask() -> None:
    values, mask = to_padded(response([[1, 2, 3], [4]], [[], [5, 6]]))
    np.testing.assert_array_equal(values, [[1, 2, 3], [4, 0, 0], [0, 0, 0], [5, 6, 0]])
    np.testing.assert_array_equal(mask.sum(axis=1), [3, 1, 0, 2])
    assert values.dtype == np.float32 and mask.dtype == bool


def test_max_len_widens_and_pad_value_fills() -> None:
    values, mask = to_padded(response([[1, 2]]), max_len=4, pad_value=-9.0)
    np.testing.assert_array_equal(values, [[1, 2, -9, -9]])
    np.testing.assert_array_equal(mask, [[True, True, False, False]])


def test_a_rollout_longer_than_max_len_is_an_error_not_a_truncation() -> None:
    with pytest.raises(ValueError, match="more than max_len=2"):
        to_padded(response([[1, 2, 3]]), max_len=2)


def test_stream_results_are_put_back_in_the_trainers_order_by_rollout_id() -> None:
    results = [
        {"id": "b", "rollouts": [{"rollout_id": "b0", "advantages": np.array([3.0])}]},
        {"id": "x", "error": {"code": "invalid_value"}, "rollout_ids": ["x0"]},
        {
            "id": "a",
            "rollouts": [
                {"rollout_id": "a1", "advantages": np.array([2.0, 2.0])},
                {"rollout_id": "a0", "advantages": np.array([1.0])},
            ],
        },
    ]
    values, _ = to_padded(results, order=["a0", "a1", "b0"])
    np.testing.assert_array_equal(values, [[1, 0], [2, 2], [3, 0]])
    with pytest.raises(KeyError, match="x0"):
        to_padded(results, order=["a0", "x0"])


def test_other_per_token_keys_and_dtypes() -> None:
    group = {"id": "g", "rollouts": [{"advantages": [1.0], "ktae_score": [0.5, 0.25]}]}
    values, _ = to_padded(group, key="ktae_score", dtype=np.float64)
    assert values.dtype == np.float64 and values.tolist() == [[0.5, 0.25]]
    assert len(result_rollouts([group, group])) == 2


def test_empty_inputs() -> None:
    values, mask = pad_arrays([])
    assert values.shape == (0, 0) and mask.shape == (0, 0)
    values, mask = pad_arrays([np.zeros(0), np.zeros(0)], max_len=3)
    assert values.shape == (2, 3) and not mask.any()


def test_matches_a_row_by_row_reference() -> None:
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=int(n)).astype(np.float32) for n in rng.integers(0, 50, size=40)]
    values, mask = pad_arrays(arrays, max_len=64)
    for row, a in enumerate(arrays):
        np.testing.assert_array_equal(values[row, : a.size], a)
        assert not values[row, a.size :].any()
        assert mask[row].sum() == a.size and mask[row, : a.size].all()


def test_a_mask_with_holes_and_left_padding_places_each_value_at_its_token() -> None:
    mask = np.array([[0, 1, 0, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 1, 1]], bool)
    values, out_mask = to_padded(response([[1, 2, 3], [4, 5]], [[], [6, 7]]), mask=mask)
    np.testing.assert_array_equal(
        values, [[0, 1, 0, 2, 3], [4, 5, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 6, 7]]
    )
    assert out_mask is not None and out_mask.tolist() == mask.tolist()
    with pytest.raises(ValueError, match="rollout 0 has 3 values; its mask row has 2"):
        to_padded(response([[1, 2, 3], [4, 5]]), mask=mask[:2] & np.array([1, 0, 1, 1, 1], bool))
