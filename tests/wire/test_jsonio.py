"""The bounded JSON decode (``jsonio.loads_request``) gives what ``json.loads`` gives, but for
the rollouts' arrays being numpy arrays of the same values, and refuses bodies over the limits
from their commas before any number is parsed."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from advantage_service.errors import LimitExceeded, RequestError
from advantage_service.wire.jsonio import BodyLimits, loads_request
from hypothesis import given, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=80, deadline=None)


def plain(value: Any) -> Any:
    """``value`` with numpy arrays as lists, for comparing with json.loads."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def same(got: Any, want: Any) -> None:
    """Equal values; outside the rollouts' float arrays (where 1 may be read as 1.0) with int
    and float kept apart too, token ids above all (json's 2.0 is not a token id)."""

    def typed(value: Any, in_floats: bool = False) -> Any:
        if isinstance(value, dict):
            return {
                k: typed(v, in_floats or k in ("logprobs", "teacher_logprobs"))
                for k, v in value.items()
            }
        if isinstance(value, list):
            return [typed(v, in_floats) for v in value]
        if isinstance(value, float | int) and not isinstance(value, bool) and in_floats:
            return float(value)
        return value

    assert json.dumps(typed(plain(got))) == json.dumps(typed(want))


numbers = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=8)),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=20,
)
number_lists = st.lists(numbers, max_size=12)


@SETTINGS
@given(
    st.lists(
        st.fixed_dictionaries(
            {
                "tokens": st.lists(st.integers(-(2**40), 2**40), max_size=12),
                "reward": numbers,
                "logprobs": number_lists,
                "teacher_logprobs": st.dictionaries(st.text(max_size=4), number_lists, max_size=2),
            }
        ),
        max_size=4,
    ),
    json_values,
    st.sampled_from([None, 0, 2]),
)
def test_the_decode_is_json_loads_with_the_rollouts_arrays_as_numpy(
    rollouts: list[dict[str, Any]], extra: Any, indent: int | None
) -> None:
    body = {
        "request_id": "r[1,2]",  # an array inside a string is a string
        "ignore_token_ids": [151643, 0],
        "estimator": {"outcome": "grpo", "note": extra},
        "groups": [{"id": 'g"[3]', "rollouts": rollouts}],
    }
    text = json.dumps(body, indent=indent).encode()
    got = loads_request(text)
    same(got, json.loads(text))
    # Within the limits, the bounded scan refuses nothing and gives the same.
    same(loads_request(text, BodyLimits(max_tokens=10**6, max_rollouts=100)), json.loads(text))
    assert isinstance(got["ignore_token_ids"], list)  # arrays outside rollouts stay lists
    for rollout in got["groups"][0]["rollouts"]:
        # Token ids reach the builder as numpy arrays (json's lists only past int64).
        assert isinstance(rollout["tokens"], np.ndarray)


@SETTINGS
@given(json_values)
def test_any_json_decodes_as_json_loads_decodes_it(value: Any) -> None:
    text = json.dumps({"groups": [{"id": "g", "rollouts": [{"tokens": value}]}], "x": value})
    same(loads_request(text.encode()), json.loads(text))


def test_malformed_and_mixed_arrays_keep_json_semantics() -> None:
    body = (
        b'{"groups":[{"id":"g","rollouts":['
        b'{"tokens":[1,true],"reward":1},'
        b'{"tokens":[1,[2]],"reward":0},'
        b'{"tokens":[1.5, 2e3, -0.0],"reward":0},'
        b'{"tokens":[ ],"reward":0},'
        b'{"tokens":[99999999999999999999999],"reward":0}]}]}'
    )
    got = loads_request(body)["groups"][0]["rollouts"]
    assert got[0]["tokens"] == [1, True] and got[1]["tokens"] == [1, [2]]
    assert got[2]["tokens"] == [1.5, 2000.0, -0.0]  # not all integers: json's list
    assert got[3]["tokens"].size == 0
    assert got[4]["tokens"] == [99999999999999999999999]  # beyond int64: json's exact int
    with pytest.raises(RequestError) as info:
        loads_request(b'{"groups": [1, 2,, 3]}')
    assert info.value.code == "invalid_json"


def test_deep_nesting_is_a_request_error_not_a_crash() -> None:
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000):
        with pytest.raises(RequestError) as info:
            loads_request(body)
        assert info.value.code == "invalid_json" and info.value.status == 422


def test_limits_are_checked_from_the_commas_before_the_numbers_are_parsed() -> None:
    rollout = {"tokens": list(range(10)), "reward": 1.0, "logprobs": [-1.0] * 10}
    body = json.dumps({"groups": [{"id": "g", "rollouts": [rollout] * 5}]}).encode()
    loads_request(body, BodyLimits(max_tokens=50, max_rollouts=5))
    with pytest.raises(LimitExceeded) as tokens:
        loads_request(body, BodyLimits(max_tokens=49, max_rollouts=5))
    assert (tokens.value.status, tokens.value.field) == (413, "tokens")
    assert "50 tokens" in tokens.value.message
    with pytest.raises(LimitExceeded) as rollouts:
        loads_request(body, BodyLimits(max_tokens=50, max_rollouts=4))
    assert (
        rollouts.value.field == "rollouts" and "ADV_MAX_REQUEST_ROLLOUTS" in rollouts.value.message
    )
    # A marker-like string a client sends is a string: the markers carry a per-call nonce.
    forged = json.dumps({"groups": [{"id": "g", "rollouts": [{"tokens": "\x01:0"}]}]})
    assert loads_request(forged.encode())["groups"][0]["rollouts"][0]["tokens"] == "\x01:0"
