"""Arrays from any framework (advantage_contract.arrays) and every path that reads them: torch
tensors of any dtype, ml_dtypes' bfloat16 (what numpy makes of a JAX bfloat16 array), 0-d
arrays and numpy scalars where a number is asked, read-only buffers. JAX arrays themselves are
tested in their own environment (tests/trainers/test_jax_arrays.py)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from advantage_client.grpc_codec import from_tensor, rollout_message
from advantage_client.http_client import _json_default
from advantage_contract import arrays
from advantage_contract.errors import AdvantageError
from advantage_contract.flat import flatten_groups
from advantage_contract.padded import WireRequest
from advantage_service import compute_padded
from client_support import padded_request
from oracle import reference_compute


def bf16_round(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest, ties to even) and back, by bit arithmetic:
    the top 16 bits of the float32 after adding half an ulp of bfloat16."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


VALUES = np.array([0.1, -1.7, 3.14159, 1e-3, 2.5, -0.3], dtype=np.float32)


def test_bf16_oracle_rounds_to_eight_bits() -> None:
    assert bf16_round(np.array([1.0, 0.1], np.float32)).tolist() == [1.0, 0.10009765625]


def test_host_float32_and_int32_are_not_copied() -> None:
    for array in (VALUES, np.arange(5, dtype=np.int32)):
        assert arrays.to_numpy(array) is array
    tensor = torch.from_numpy(VALUES.copy())
    assert np.shares_memory(arrays.to_numpy(tensor), tensor.numpy())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_half_is_widened_exactly(dtype: torch.dtype) -> None:
    tensor = torch.from_numpy(VALUES).to(dtype).requires_grad_(True)
    out = arrays.to_numpy(tensor)
    assert out.dtype == np.float32
    expected = bf16_round(VALUES) if dtype == torch.bfloat16 else VALUES.astype(np.float16)
    np.testing.assert_array_equal(out, expected.astype(np.float32))


def test_ml_dtypes_bfloat16_is_widened_exactly() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    out = arrays.to_numpy(VALUES.astype(ml_dtypes.bfloat16))
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, bf16_round(VALUES))


def test_numpy_float16_is_widened_and_others_kept() -> None:
    assert arrays.to_numpy(VALUES.astype(np.float16)).dtype == np.float32
    assert arrays.to_numpy(np.arange(3, dtype=np.int64)).dtype == np.int64
    assert arrays.to_numpy([1.0, 2.0]).tolist() == [1.0, 2.0]


def test_not_an_array_names_the_field() -> None:
    with pytest.raises(AdvantageError) as info:
        arrays.to_numpy(object(), "logprobs")
    assert info.value.code == "invalid_type" and info.value.field == "logprobs"


@pytest.mark.parametrize(
    "value, expected",
    [
        (np.float32(1.5), 1.5),
        (np.array(2.25), 2.25),
        (np.int64(3), 3),
        (torch.tensor(0.5), 0.5),
        (torch.tensor(0.1, dtype=torch.bfloat16), 0.10009765625),
    ],
)
def test_zero_d_values_are_numbers(value: object, expected: float) -> None:
    number = arrays.to_number(value)
    assert type(number) in (int, float) and number == expected


def test_to_number_leaves_other_values_for_the_check() -> None:
    vector = np.array([1.0, 2.0])
    assert arrays.to_number(vector) is vector
    assert arrays.to_number("1") == "1"
    assert arrays.to_number(np.bool_(True)) is True  # (refused as a boolean by is_number)


def test_read_only_buffer_becomes_a_tensor_without_warning() -> None:
    frozen = VALUES.copy()
    frozen.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tensor = arrays.torch_tensor(frozen)
    # (torch warns once per process: the copy is what shows it was never shared)
    assert not np.shares_memory(tensor.numpy(), frozen)
    np.testing.assert_array_equal(tensor.numpy(), VALUES)
    writable = VALUES.copy()
    assert np.shares_memory(arrays.torch_tensor(writable).numpy(), writable)


def _rollouts(reward: object, logprobs: object, tokens: object) -> dict:
    return {
        "groups": [
            {
                "id": "g",
                "rollouts": [
                    {"tokens": tokens, "reward": reward, "logprobs": logprobs},
                    {"tokens": [5, 6, 7], "reward": 0.0, "logprobs": [-0.5, -0.5, -0.5]},
                ],
            }
        ]
    }


def test_nested_request_takes_torch_values_and_zero_d_rewards() -> None:
    half = torch.tensor([-0.1, -0.2, -0.3], dtype=torch.bfloat16)
    request = _rollouts(torch.tensor(1.0), half, torch.tensor([1, 2, 3]))
    wire = WireRequest.from_json(request)
    np.testing.assert_array_equal(wire.rows.rewards, [1.0, 0.0])
    np.testing.assert_array_equal(wire.tokens, [1, 2, 3, 5, 6, 7])
    assert wire.per_token["logprobs"].dtype == np.float32
    np.testing.assert_array_equal(
        wire.per_token["logprobs"][:3], bf16_round(np.array([-0.1, -0.2, -0.3], np.float32))
    )
    body = json.loads(json.dumps(request, default=_json_default))
    assert body["groups"][0]["rollouts"][0]["reward"] == 1.0
    assert body["groups"][0]["rollouts"][0]["tokens"] == [1, 2, 3]


def test_a_vector_reward_is_still_refused_naming_it() -> None:
    with pytest.raises(AdvantageError) as info:
        flatten_groups(_rollouts(np.array([1.0, 2.0]), [0.0] * 3, [1, 2, 3])["groups"])
    assert (info.value.field, info.value.rollout_index) == ("reward", 0)


def test_ids_wider_than_int32_keep_their_width() -> None:
    wide = torch.tensor([1, 2**40, 3])
    flat = flatten_groups(_rollouts(1.0, [0.0] * 3, wide)["groups"]).for_wire()
    assert flat.tokens.dtype == np.int64 and int(flat.tokens[1]) == 2**40


def test_stream_rollout_takes_torch_values() -> None:
    message = rollout_message(
        {
            "group_id": "g",
            "group_size": np.int64(2),
            "tokens": torch.tensor([4, 5]),
            "reward": torch.tensor(0.75, dtype=torch.float64),
            "logprobs": torch.tensor([-0.1, -0.2], dtype=torch.bfloat16),
        }
    )
    assert message.reward == 0.75
    np.testing.assert_array_equal(
        from_tensor(message.logprobs), bf16_round(np.array([-0.1, -0.2], np.float32))
    )


def test_padded_request_takes_bfloat16_per_token_values() -> None:
    mask = np.array([[1, 1, 0], [1, 1, 1]], dtype=bool)
    logprobs = torch.tensor([[-0.1, -0.2, 0.0], [-0.3, -0.4, -0.5]], dtype=torch.bfloat16)
    req = padded_request(
        np.ones((2, 3), np.int32),
        mask,
        torch.tensor([1.0, 0.0], dtype=torch.bfloat16),
        ["a", "a"],
        estimator="ktae",
        logprobs=logprobs,
    )
    np.testing.assert_array_equal(req.per_token["logprobs"], logprobs.float().numpy()[mask])


def _grpo_reference(mask: np.ndarray, rewards: np.ndarray) -> list[float]:
    rollouts = [
        {"tokens": [1] * int(n), "reward": float(r)}
        for n, r in zip(mask.sum(1), rewards, strict=True)
    ]
    request = {"estimator": "grpo", "groups": [{"id": "a", "rollouts": rollouts}]}
    return [r["scalar"] for r in reference_compute(request)["groups"][0]["rollouts"]]


MASK = np.array([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=bool)
REWARDS = np.array([1.0, 0.1, 0.0], dtype=np.float32)


@pytest.mark.parametrize("estimator", ["grpo", "ktae"])
def test_in_process_takes_read_only_arrays_without_warning(
    estimator: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (torch warns once per process: a spy sees every array it is given instead)
    real = torch.from_numpy

    def writable_only(array: np.ndarray) -> torch.Tensor:
        assert array.flags.writeable, "a read-only array reached torch.from_numpy"
        return real(array)

    monkeypatch.setattr(torch, "from_numpy", writable_only)
    frozen = [MASK.copy(), REWARDS.copy(), np.ones((3, 3), np.int32)]
    for array in frozen:
        array.flags.writeable = False
    out = compute_padded(frozen[2], frozen[0], frozen[1], ["a"] * 3, estimator=estimator)
    if estimator == "grpo":
        np.testing.assert_allclose(out.scalars, _grpo_reference(MASK, REWARDS), atol=1e-6)


def test_in_process_takes_ml_dtypes_bfloat16() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    out = compute_padded(
        np.ones((3, 3), np.int32),
        MASK,
        REWARDS.astype(ml_dtypes.bfloat16),
        ["a"] * 3,
        estimator="grpo",
        logprobs=np.full((3, 3), -0.1, np.float32).astype(ml_dtypes.bfloat16),
    )
    expected = _grpo_reference(MASK, bf16_round(REWARDS))
    np.testing.assert_allclose(out.scalars, expected, rtol=1e-6, atol=1e-6)
