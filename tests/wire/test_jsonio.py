"""The bounded JSON decode (``jsonio.loads_request``) gives what ``json.loads`` gives, but for
the rollouts' arrays being numpy arrays of the same values, and refuses bodies over the limits
from their commas before any number is parsed."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from advantage_contract.fields import GROUP_FIELDS, ROLLOUT_FIELDS, TOP_LEVEL_FIELDS
from advantage_service.errors import LimitExceeded, RequestError
from advantage_service.wire import jsonio
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


# ---- the decoder's paths: msgspec's Structs, field by field, and what msgspec does not read ----

LIMITS = BodyLimits(max_tokens=10**6, max_rollouts=100)


def test_the_structs_have_the_contracts_fields_in_its_order() -> None:
    """The guard checks that a body lists its fields in this order before the Structs (which
    keep their own order, not the body's) read it: the two must agree."""
    assert jsonio._Rollout.__struct_fields__ == ROLLOUT_FIELDS
    assert jsonio._Group.__struct_fields__ == GROUP_FIELDS
    assert jsonio._Request.__struct_encode_fields__ == TOP_LEVEL_FIELDS


@SETTINGS
@given(
    st.permutations(["tokens", "reward", "logprobs", "teacher_logprobs"]),
    st.permutations(["id", "prompt_key", "rollouts"]),
    st.permutations(["request_id", "estimator", "return", "groups"]),
    st.booleans(),
)
def test_fields_in_any_order_decode_as_json_loads_keeps_them(
    rollout_keys: list[str], group_keys: list[str], top_keys: list[str], twice: bool
) -> None:
    values: dict[str, Any] = {
        "tokens": [5, 6],
        "reward": 0.5,
        "logprobs": [-0.25, -1e-7],
        "teacher_logprobs": {"b": [-1.0, -2.0], "a": [-3, 4]},
        "id": "g",
        "prompt_key": "p",
        "request_id": "r",
        "estimator": {"outcome": "grpo"},
        "return": ["scalar"],
    }
    rollout = {k: values[k] for k in rollout_keys}
    values["rollouts"] = [rollout, {**rollout, "reward": 1}]
    values["groups"] = [{k: values[k] for k in group_keys}]
    text = json.dumps({k: values[k] for k in top_keys}).encode()
    if twice:  # a field given twice: json keeps its first place and its last value
        text = text.replace(b'"reward": 0.5', b'"reward": 7, "reward": 0.5', 1)
    for limits in (None, LIMITS):
        same(loads_request(text, limits), json.loads(text))
        assert list(loads_request(text, limits)) == list(json.loads(text))


BAD_JSON_TEXT = [
    b"NaN",
    b"Infinity",
    b"-Infinity",
    b'"\\ud800"',
    b'"x\xff"',
    b'"\xed\xa0\x80"',
]


@pytest.mark.parametrize("literal", BAD_JSON_TEXT)
@pytest.mark.parametrize("limits", [None, LIMITS], ids=["unbounded", "bounded"])
def test_what_msgspec_does_not_read_decodes_as_json_reads_it(
    literal: bytes, limits: BodyLimits | None
) -> None:
    """NaN, Infinity, lone surrogates and bytes that are not UTF-8: json reads them (the
    request's checks then refuse them, naming where they are); so does the decoder, wherever
    they are, and the rest of the body is decoded as usual."""
    key = literal if literal.startswith(b'"') else b'"k"'
    body = (
        b'{"estimator": {"outcome": {"name": "grpo", "x": %s}}, "groups": [{"id": "g",'
        b' "rollouts": [{"tokens": [1, 2], "reward": %s, "logprobs": [-0.5, %s],'
        b' "teacher_logprobs": {%s: [-1, -2]}}, {"tokens": [3], "reward": 0,'
        b' %s: [4]}]}], "request_id": %s}'
    ) % (literal, literal, literal, key, key, literal)
    got = loads_request(body, limits)
    want = jsonio.loads(body)
    assert repr(plain(got)) == repr(want)  # (repr: NaN is not equal to itself)
    rollouts = got["groups"][0]["rollouts"]
    assert isinstance(rollouts[0]["tokens"], np.ndarray)
    assert isinstance(rollouts[1]["tokens"], np.ndarray)


def test_nan_where_a_key_belongs_is_invalid_json_as_for_json() -> None:
    for limits in (None, LIMITS):
        with pytest.raises(RequestError) as info:
            loads_request(b'{"groups": [{"id": "g", NaN: 1}], "request_id": NaN}', limits)
        assert info.value.code == "invalid_json"


def test_a_body_in_utf16_or_with_a_byte_order_mark_decodes_as_json_loads_reads_it() -> None:
    obj = {"groups": [{"id": "é😀", "rollouts": [{"tokens": [1, 2], "reward": 1}]}]}
    text = json.dumps(obj, ensure_ascii=False)
    for body in (
        b"\xef\xbb\xbf" + text.encode(),
        text.encode("utf-16"),
        text.encode("utf-32-le"),
    ):
        for limits in (None, LIMITS):
            same(loads_request(body, limits), json.loads(body))
    with pytest.raises(RequestError) as info:
        loads_request(text.encode("utf-16-le")[:-1], LIMITS)  # (half a character)
    assert info.value.code == "invalid_json"


def test_integers_numpy_would_saturate_are_jsons_exact_integers() -> None:
    """numpy reads an integer beyond int64 as 2**63 - 1, whatever its sign: one of 19 digits
    or more is json's (as before, when a regex found them)."""
    for token in (2**63, -(2**63) - 1, 10**19, -(10**20), 10**18, -(10**18)):
        body = json.dumps({"groups": [{"id": "g", "rollouts": [{"tokens": [1, token]}]}]})
        for limits in (None, LIMITS):
            tokens = loads_request(body.encode(), limits)["groups"][0]["rollouts"][0]["tokens"]
            assert tokens == [1, token] and isinstance(tokens, list)
    body = b'{"groups": [{"id": "g", "rollouts": [{"tokens": [1], "logprobs": [1e999, 2]}]}]}'
    logprobs = loads_request(body, LIMITS)["groups"][0]["rollouts"][0]["logprobs"]
    assert logprobs == [float("inf"), 2]  # (json's: msgspec refuses a float beyond float64)
