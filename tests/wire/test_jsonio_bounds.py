"""What the JSON decoder refuses while it scans (``loads_request`` with limits), and that it
holds almost nothing to do so: strings over the lengths the request schema allows, counts over
the limits (with the request's exact counts), and structures no request has."""

from __future__ import annotations

import contextlib
import json
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
from advantage_service.errors import RequestError
from advantage_service.wire.jsonio import BodyLimits, loads_request

LIMITS = BodyLimits(max_tokens=1_000, max_rollouts=100)
ROLLOUT = {"tokens": [1, 2], "reward": 1.0}
MIB = 2**20


def request(**fields: Any) -> dict[str, Any]:
    return {"groups": [{"id": "g", "rollouts": [ROLLOUT]}], **fields}


def refusal(body: bytes | dict[str, Any], limits: BodyLimits = LIMITS) -> RequestError:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(RequestError) as info:
        loads_request(data, limits)
    return info.value


def traced_peak(action: Callable[[], Any]) -> int:
    """The most Python allocated (bytes, tracemalloc) while ``action`` ran."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        with contextlib.suppress(RequestError):
            action()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def with_teacher(name: str) -> dict[str, Any]:
    return {
        "groups": [{"id": "g", "rollouts": [{**ROLLOUT, "teacher_logprobs": {name: [-1, -1]}}]}]
    }


# (build a request around a string, its limit, status, code, field)
PLACES: dict[str, tuple[Callable[[str], dict[str, Any]], int, int, str, str]] = {
    "group id": (
        lambda s: {"groups": [{"id": s, "rollouts": [ROLLOUT]}]},
        256,
        413,
        "limit_exceeded",
        "id",
    ),
    "request_id": (lambda s: request(request_id=s), 256, 413, "limit_exceeded", "request_id"),
    "namespace": (lambda s: request(namespace=s), 128, 422, "invalid_type", "namespace"),
    "condition name": (with_teacher, 64, 413, "limit_exceeded", "teacher_logprobs"),
    "preset": (lambda s: request(estimator=s), 64, 422, "unknown_estimator", "estimator"),
    "parameter value": (
        lambda s: request(estimator={"outcome": {"name": "grpo", "x": s}}),
        64,
        422,
        "invalid_parameter",
        "estimator",
    ),
    "return name": (
        lambda s: request(**{"return": ["scalar", s]}),
        64,
        422,
        "invalid_parameter",
        "return",
    ),
    "unknown group field's value": (
        lambda s: {"groups": [{"id": "g", "note": s, "rollouts": [ROLLOUT]}]},
        256,
        413,
        "limit_exceeded",
        "note",
    ),
    "a reward given as text": (
        lambda s: {"groups": [{"id": "g", "rollouts": [{"tokens": [1], "reward": s}]}]},
        256,
        413,
        "limit_exceeded",
        "reward",
    ),
}


@pytest.mark.parametrize("place", list(PLACES))
@pytest.mark.parametrize(
    "char", ["a", "é", "😀"], ids=["ascii", "two-byte", "escaped surrogate pair"]
)
def test_a_string_at_its_limit_passes_the_scan_and_one_character_more_is_refused(
    place: str, char: str
) -> None:
    build, limit, status, code, field = PLACES[place]
    # json.dumps escapes non-ASCII: the emoji travels as \ud83d\ude00, 12 bytes a character.
    loads_request(json.dumps(build(char * limit)).encode(), LIMITS)
    error = refusal(build(char * (limit + 1)))
    assert (error.status, error.code, error.field) == (status, code, field), error
    # (the exact count, or "more than" where the string's escapes are too many to be worth
    # decoding; the namespace's refusal is parse_options' words)
    said = ["128 characters"] if place == "namespace" else [f"{limit + 1} characters"]
    said.append(f"more than {limit} characters")
    assert any(x in error.message for x in said), error.message
    assert char * 8 not in error.message


@pytest.mark.parametrize("place", list(PLACES))
def test_a_megabyte_string_is_refused_holding_almost_nothing(place: str) -> None:
    """The regex that matched strings whole held ~130 bytes per character of one: a 4 MB
    string cost ~500 MB before it was refused. Now the scan stops at it, having held the
    regex engine's state for a string of the longest length allowed (~0.5 MB) at most."""
    build, _, status, code, field = PLACES[place]
    data = json.dumps(build("x" * 4_000_000)).encode()
    error = refusal(data)
    assert (error.status, error.code, error.field) == (status, code, field)
    assert "characters" in error.message and "xxxxxxxx" not in error.message
    assert traced_peak(lambda: loads_request(data, LIMITS)) < MIB


def test_a_long_key_is_refused_naming_where_it_is() -> None:
    long = "k" * 100
    cases = [
        ({long: 1, "groups": []}, 422, "unknown_field", "request"),
        ({"groups": [{"id": "g", long: 1, "rollouts": [ROLLOUT]}]}, 422, "unknown_field", "groups"),
        (
            request(estimator={"outcome": {"name": "grpo", long: 1}}),
            422,
            "invalid_parameter",
            "estimator",
        ),
    ]
    for obj, status, code, field in cases:
        error = refusal(obj)
        assert (error.status, error.code, error.field) == (status, code, field), error
        assert "kkkkkkkk" not in error.message


def test_an_unknown_top_level_field_is_refused_before_its_value_is_read() -> None:
    data = b'{"groups": [], "note": [' + b"[1]," * 1_000_000 + b"[1]]}"
    error = refusal(data)
    assert (error.code, error.field) == ("unknown_field", "note")
    assert traced_peak(lambda: loads_request(data, LIMITS)) < 64 * 1024


def test_counts_over_the_limits_give_the_exact_counts_after_a_scan_that_keeps_nothing() -> None:
    rollout = b'{"tokens":[1,2,3],"reward":1}'
    many = b'{"groups":[{"id":"g","rollouts":[' + b",".join([rollout] * 200_000) + b"]}]}"
    error = refusal(many)
    assert (error.status, error.field) == (413, "rollouts")
    assert "200000 rollouts" in error.message and "ADV_MAX_REQUEST_ROLLOUTS" in error.message
    # The skeleton of 200,000 rollouts would be ~60 MB of Python objects: none is built.
    assert traced_peak(lambda: loads_request(many, LIMITS)) < MIB
    long = {"groups": [{"id": "g", "rollouts": [{"tokens": [1] * 600, "reward": 1}] * 2}]}
    error = refusal(long)
    assert (error.field, error.message.split(";")[0]) == ("tokens", "the request has 1200 tokens")
    values = {"groups": [{"id": "g", "rollouts": [{**ROLLOUT, "logprobs": [-1] * 1_001}]}]}
    error = refusal(values)
    assert (error.status, error.field) == (413, "logprobs") and "1001 logprobs" in error.message


def test_what_the_schema_bounds_is_refused_as_it_is_met() -> None:
    cases: list[tuple[Any, int, str, str | None]] = [
        (request(ignore_token_ids=list(range(65_537))), 413, "limit_exceeded", "ignore_token_ids"),
        (request(**{"return": ["scalar"] * 65}), 422, "invalid_parameter", "return"),
        (
            request(estimator={"outcome": "grpo", "whiten": [0] * 9_000}),
            422,
            "invalid_parameter",
            "estimator",
        ),
        (
            {
                "groups": [
                    {
                        "id": "g",
                        "rollouts": [
                            {**ROLLOUT, "teacher_logprobs": {f"c{i}": [-1, -1]}} for i in range(65)
                        ],
                    }
                ]
            },
            413,
            "limit_exceeded",
            "teacher_logprobs",
        ),
        (
            b'{"groups": [{"id": "g", "rollouts": [{"tokens": [1], "reward": 1'
            + b', "reward": 1' * 20
            + b"}]}]}",
            422,
            "invalid_json",
            "reward",
        ),
        (b"[" * 100 + b"]" * 100, 422, "invalid_json", None),
        (json.dumps(request()).encode() + b" {}", 422, "invalid_json", None),
    ]
    for obj, status, code, field in cases:
        error = refusal(obj)
        assert (error.status, error.code, error.field) == (status, code, field), error


def test_json_where_the_schema_has_none_is_kept_for_its_error_up_to_a_mebibyte() -> None:
    small = {"groups": [{"id": "g", "rollouts": [{"tokens": [1], "reward": [[1], [2]]}]}]}
    assert loads_request(json.dumps(small).encode(), LIMITS)["groups"][0]["rollouts"][0][
        "reward"
    ] == [[1], [2]]  # (the builder names it: reward must be a number)
    big = b'{"groups": [{"id": "g", "rollouts": [{"tokens": [1], "reward": [' + b"[1]," * 400_000
    error = refusal(big + b"[1]]}]}]}")
    assert (error.code, error.field, error.group_id, error.rollout_index) == (
        "invalid_type",
        "reward",
        "g",
        0,
    )
    unknown = b'{"groups": [{"id": "g", "note": [' + b"[1]," * 400_000 + b'[1]], "rollouts": []}]}'
    error = refusal(unknown)
    assert (error.code, error.field, error.group_id) == ("unknown_field", "note", "g")
    assert traced_peak(lambda: loads_request(unknown, LIMITS)) < 2 * MIB


def test_a_long_array_of_numbers_is_counted_a_chunk_at_a_time_holding_almost_nothing() -> None:
    """An array of numbers is checked and counted without copying it whole (a copy of a
    4-million-token array would be 8 MB)."""
    data = b'{"groups": [{"id": "g", "rollouts": [{"tokens": [' + b"1," * 4_000_000 + b"1]}]}]}"
    error = refusal(data)
    assert (error.status, error.field) == (413, "tokens")
    assert "4000001 tokens" in error.message
    assert traced_peak(lambda: loads_request(data, LIMITS)) < MIB


def test_an_array_of_numbers_but_one_far_into_it_is_json_where_the_schema_has_none() -> None:
    """The check of an array's text goes on past its first chunk: an array of numbers with a
    true at its end is no per-token array (not counted as one), and more than a mebibyte of it
    is refused as JSON the schema does not take."""
    data = b'{"groups": [{"id": "g", "rollouts": [{"tokens": [' + b"1," * 600_000 + b"true]}]}]}"
    error = refusal(data)
    assert (error.status, error.code, error.field) == (422, "invalid_type", "tokens")
    assert (error.group_id, error.rollout_index) == ("g", 0)


def test_json_where_the_schema_has_none_is_bounded_in_all_not_per_value() -> None:
    """Arrays of numbers where a number belongs (a reward), each small, count toward the one
    mebibyte the request may hold of such JSON."""
    rollout = {"tokens": [1], "reward": [1] * 6_000}  # 18 KB of JSON where a number belongs
    error = refusal({"groups": [{"id": "g", "rollouts": [rollout] * 90}]})
    assert (error.status, error.code, error.field) == (422, "invalid_type", "reward")
    assert (error.group_id, error.rollout_index) == ("g", 58)  # (18 KB each: the 59th passes 1 MiB)
