"""The HTTP client's JSON request body (advantage_client.http_client.dumps_request): written by
orjson where it can, it reads back as the json module's body does (the same float32 values for
float32 arrays, the same integers, strings and structure), and where orjson would write
something else (NaN as null, a None, an integer past 64 bits, a key that is not a string) the
body is the json module's, byte for byte."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
from advantage_client.http_client import _json_default, dumps_request


def json_module_body(request: Any) -> bytes:
    return json.dumps(request, default=_json_default).encode()


PER_TOKEN = {"tokens", "logprobs", "entropy", "is_weights", "pos"}


def same(a: Any, b: Any, float32: bool = False) -> bool:
    """Equal structure and values; in a per-token array (``float32``) floats equal as float32
    (such an array is float32 on every wire, and written in its shortest float32 form it reads
    back as the same float32 value); everything else exactly."""
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and list(a) == list(b)
            and all(same(a[k], b[k], k in PER_TOKEN) for k in a)
        )
    if isinstance(a, list):
        return (
            isinstance(b, list)
            and len(a) == len(b)
            and all(same(x, y, float32) for x, y in zip(a, b, strict=True))
        )
    if float32 and isinstance(a, float):
        return isinstance(b, float) and bool(np.float32(a) == np.float32(b))
    return bool(a == b) and type(a) is type(b)


def request(rng: np.random.Generator) -> dict[str, Any]:
    rollouts = []
    for i in range(5):
        n = int(rng.integers(0, 40))
        rollouts.append(
            {
                "tokens": rng.integers(0, 151_936, n),
                "reward": np.float32(rng.random()) if i % 2 else float(rng.random()),
                "logprobs": (-rng.exponential(size=n)).astype(np.float32),
                "entropy": torch.from_numpy(rng.gamma(0.5, 1.0, n).astype(np.float32)),
                "is_weights": rng.random(2 * n)[::2],  # (a strided view: not contiguous)
                "teacher_logprobs": {"pos": list(map(float, -rng.exponential(size=n)))},
            }
        )
    # (a float32 parameter reads back as the float64 json wrote: digests stay the same)
    estimator = {"outcome": {"name": "grpo", "epsilon": np.float32(1e-6)}, "terms": {}}
    return {"estimator": estimator, "groups": [{"id": "g0", "rollouts": rollouts}]}


def test_the_body_reads_back_as_the_json_module_writes_it() -> None:
    for seed in range(5):
        req = request(np.random.default_rng(seed))
        fast, slow = dumps_request(req), json_module_body(req)
        assert len(fast) < len(slow)  # (orjson wrote it: float32 in their shortest form)
        assert same(json.loads(fast), json.loads(slow))


@pytest.mark.parametrize(
    "value",
    [
        np.array([0.5, np.nan], dtype=np.float32),
        [0.5, float("inf")],
        None,
        [2**70],
    ],
    ids=["numpy NaN", "list infinity", "None", "integer past 64 bits"],
)
def test_what_orjson_would_write_otherwise_is_the_json_modules_body(value: Any) -> None:
    req = {"estimator": "grpo", "groups": [{"id": "g", "rollouts": [{"logprobs": value}]}]}
    assert dumps_request(req) == json_module_body(req)


def test_a_key_that_is_no_string_and_an_unknown_object_are_as_the_json_module_has_them() -> None:
    req = {"groups": [{"id": "g", "rollouts": [{"teacher_logprobs": {1: [0.5]}}]}]}
    assert dumps_request(req) == json_module_body(req)
    with pytest.raises(TypeError, match="not JSON serialisable"):
        dumps_request({"groups": object()})
