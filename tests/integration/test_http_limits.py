"""A JSON body is refused as the decoder scans it, before anything of it is built: one long
string anywhere costs the service at most 2x the body's bytes + 16 MiB of peak RSS (it cost
~130x), refused with the field named and the string not repeated; the same lengths as gRPC;
integer rewards a float64 cannot hold and empty group ids are refused; echoes stay short.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from http_support import Server, start_server
from memory_support import peak_growth

pytestmark = pytest.mark.integration

MIB = 2**20
LONG = 10_000_000
SMALL_GROUP = {"id": "g", "rollouts": [{"tokens": [1, 2], "reward": 1.0}]}


@pytest.fixture(scope="module")
def roomy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server that reads bodies of up to 64 MiB (the long strings are 10 MB)."""
    server = start_server(tmp_path_factory.mktemp("roomy"), max_body_bytes=64 * MIB)
    yield server
    server.stop()


def body(obj: dict[str, Any], long: str, text: str) -> bytes:
    """``obj`` as JSON with the string ``"LONG"`` (a key or a value) replaced by ``text``."""
    encoded = json.dumps(obj).encode()
    assert encoded.count(b'"LONG"') == 1
    return encoded.replace(b'"LONG"', b'"' + text.encode() + b'"')


X = "x" * LONG
# name -> (request with "LONG" where the long string goes, status, code, field, group_id)
LONG_STRINGS: dict[str, tuple[dict[str, Any], str, int, str, str | None, str | None]] = {
    "group id": (
        {"groups": [{"id": "LONG", "rollouts": SMALL_GROUP["rollouts"]}]},
        X,
        413,
        "limit_exceeded",
        "id",
        None,
    ),
    "group id of escapes": (
        {"groups": [{"id": "LONG", "rollouts": SMALL_GROUP["rollouts"]}]},
        "\\n" * (LONG // 2),
        413,
        "limit_exceeded",
        "id",
        None,
    ),
    "request_id": (
        {"request_id": "LONG", "groups": [SMALL_GROUP]},
        X,
        413,
        "limit_exceeded",
        "request_id",
        None,
    ),
    "unknown top-level field's value": (
        {"groups": [SMALL_GROUP], "note": "LONG"},
        X,
        422,
        "unknown_field",
        "note",
        None,
    ),
    "unknown group field's value": (
        {"groups": [{"id": "g", "note": "LONG", "rollouts": SMALL_GROUP["rollouts"]}]},
        X,
        413,
        "limit_exceeded",
        "note",
        "g",
    ),
    "teacher condition name": (
        {
            "groups": [
                {
                    "id": "g",
                    "rollouts": [
                        {"tokens": [1], "reward": 1.0, "teacher_logprobs": {"LONG": [-1.0]}}
                    ],
                }
            ]
        },
        X,
        413,
        "limit_exceeded",
        "teacher_logprobs",
        "g",
    ),
    "preset": (
        {"estimator": "LONG", "groups": [SMALL_GROUP]},
        X,
        422,
        "unknown_estimator",
        "estimator",
        None,
    ),
    "parameter name": (
        {"estimator": {"outcome": {"name": "grpo", "LONG": 1}}, "groups": [SMALL_GROUP]},
        X,
        422,
        "invalid_parameter",
        "estimator",
        None,
    ),
}


@pytest.mark.parametrize("case", list(LONG_STRINGS))
def test_a_long_string_costs_at_most_2x_the_body_before_its_refusal(
    roomy: Server, case: str
) -> None:
    obj, text, status, code, field, group_id = LONG_STRINGS[case]
    data = body(obj, "LONG", text)

    def post() -> Any:
        return roomy.client.post(
            "/v1/advantages", content=data, headers={"content-type": "application/json"}
        )

    growth = peak_growth(roomy.proc.pid, post)
    response = growth.result
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert (error["code"], error["field"], error["group_id"]) == (code, field, group_id)
    assert len(response.content) < 1024 and "xxxxxxxxxxxxxxxx" not in response.text
    assert growth.within(len(data), 2.0), growth.describe(len(data))


def post(server: Server, obj: dict[str, Any]) -> Any:
    return server.client.post("/v1/advantages", json=obj)


def error_of(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text[:300]
    error: dict[str, Any] = response.json()["error"]
    return error


def test_an_integer_reward_beyond_2_53_is_422_naming_its_rollout(server: Server) -> None:
    rollouts = [{"tokens": [1], "reward": 0}, {"tokens": [2], "reward": 2**53 + 1}]
    error = error_of(post(server, {"groups": [{"id": "g", "rollouts": rollouts}]}), 422)
    assert (error["code"], error["field"]) == ("invalid_value", "reward")
    assert (error["group_id"], error["rollout_index"]) == ("g", 1)
    rollouts[1]["reward"] = 2**53  # (a float64 holds it exactly)
    assert post(server, {"groups": [{"id": "g", "rollouts": rollouts}]}).status_code == 200
    rollouts[1]["reward"] = -(2**53) - 1
    assert error_of(post(server, {"groups": [{"id": "g", "rollouts": rollouts}]}), 422)


def test_an_empty_group_id_is_422_as_on_grpc(server: Server) -> None:
    error = error_of(post(server, {"groups": [{**SMALL_GROUP, "id": ""}]}), 422)
    assert (error["code"], error["field"]) == ("invalid_value", "id")


def test_the_schema_bounds_are_refused_before_the_body_is_built(server: Server) -> None:
    cases = [
        ({"ignore_token_ids": list(range(65_537))}, 413, "limit_exceeded", "ignore_token_ids"),
        ({"return": ["scalar"] * 65}, 422, "invalid_parameter", "return"),
        (
            {"estimator": {"outcome": "grpo", "whiten": [0] * 9_000}},
            422,
            "invalid_parameter",
            "estimator",
        ),
        ({"namespace": "n" * 129}, 422, "invalid_type", "namespace"),
    ]
    for extra, status, code, field in cases:
        error = error_of(post(server, {"groups": [SMALL_GROUP], **extra}), status)
        assert (error["code"], error["field"]) == (code, field), error
    teachers = {f"c{i}": [-1.0] for i in range(65)}
    rollouts = [{"tokens": [1], "reward": 1.0, "teacher_logprobs": teachers}]
    error = error_of(post(server, {"groups": [{"id": "g", "rollouts": rollouts}]}), 413)
    assert (error["code"], error["field"]) == ("limit_exceeded", "teacher_logprobs")


def test_errors_repeat_at_most_a_short_part_of_what_was_sent(server: Server) -> None:
    """Values a client sent appear cut in error messages (the status stays 422)."""
    long_text = "y" * 250
    requests = [
        {"groups": [{"id": "g", "rollouts": [{"tokens": [1], "reward": long_text}]}]},
        {
            "groups": [
                {
                    "id": "g",
                    "rollouts": [
                        {"tokens": [1], "reward": 1.0, **{f"{i}" + "z" * 63: 1 for i in range(8)}}
                    ],
                }
            ]
        },
        {
            "estimator": {"outcome": {"name": "grpo", "epsilon": list(range(2_000))}},
            "groups": [SMALL_GROUP],
        },
        {"estimator": {"outcome": {"name": "grpo", "q" * 64: 1}}, "groups": [SMALL_GROUP]},
    ]
    for obj in requests:
        response = post(server, obj)
        error = error_of(response, 422)
        assert len(error["message"]) <= 300, error["message"]
        for repeated in ("y" * 100, "z" * 100, "1, 2, 3, 4, 5, 6, 7, 8, 9, 10", "q" * 65):
            assert repeated not in error["message"], error["message"]
