"""Every class of client mistake gets its status and an error body naming code, group, rollout
and field; never a 5xx. Limits answer 413 exactly above the configured values."""

from __future__ import annotations

import copy
import json
from typing import Any

import pyarrow as pa
import pytest
from http_support import (
    ARROW,
    SHARED_SETTINGS,
    Server,
    arrow_request,
    random_request,
    stream_bytes,
)

pytestmark = pytest.mark.integration


# Two groups of two rollouts, by group id.
SMALL_GROUPS: dict[str, list[dict[str, Any]]] = {
    "p0": [
        {"tokens": [1, 2, 3], "reward": 1.0, "logprobs": [-0.1, -0.2, -0.3]},
        {"tokens": [4, 5], "reward": 0.0, "logprobs": [-0.4, -0.5]},
    ],
    "p1": [
        {"tokens": [6], "reward": 0.5, "logprobs": [-0.6]},
        {"tokens": [7, 8], "reward": 0.0, "logprobs": [-0.7, -0.8]},
    ],
}


def small_request() -> dict[str, Any]:
    groups = [{"id": gid, "rollouts": copy.deepcopy(r)} for gid, r in SMALL_GROUPS.items()]
    return {"estimator": "grpo", "groups": groups}


def with_change(path: tuple[Any, ...], value: Any, delete: bool = False) -> dict[str, Any]:
    request = copy.deepcopy(small_request())
    target: Any = request
    for key in path[:-1]:
        target = target[key]
    if delete:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return request


def expect_error(
    response: Any,
    status: int,
    code: str,
    field: str | None,
    group_id: str | None = None,
    rollout_index: int | None = None,
) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"code", "message", "group_id", "rollout_index", "field"}
    assert (error["code"], error["field"]) == (code, field), error
    assert (error["group_id"], error["rollout_index"]) == (group_id, rollout_index), error
    assert error["message"]
    return error


def post_text(server: Server, body: bytes | str, content_type: str = "application/json") -> Any:
    return server.client.post(
        "/v1/advantages", content=body, headers={"content-type": content_type}
    )


# ---- 422: the request is wrong ------------------------------------------------------------------


def test_malformed_json_is_422_invalid_json(server: Server) -> None:
    expect_error(post_text(server, b'{"groups": [}'), 422, "invalid_json", None)


def test_deeply_nested_json_is_422_not_a_crash(server: Server) -> None:
    expect_error(post_text(server, "[" * 100_000 + "]" * 100_000), 422, "invalid_json", None)


def test_a_json_array_is_422_invalid_type(server: Server) -> None:
    expect_error(post_text(server, b"[]"), 422, "invalid_type", None)


def test_missing_groups_is_422(server: Server) -> None:
    request = with_change(("groups",), None, delete=True)
    expect_error(server.client.post("/v1/advantages", json=request), 422, "invalid_type", "groups")


# One value of one rollout of small_request() changed (or deleted) -> the error, which names
# that group, rollout and field: (wire, group, rollout, field, value, code).
DELETE = object()
ROLLOUT_CHANGES: dict[str, tuple[str, int, int, str, Any, str]] = {
    "missing_reward": ("json", 1, 1, "reward", DELETE, "invalid_type"),
    "reward_of_the_wrong_type": ("json", 1, 0, "reward", "high", "invalid_type"),
    "token_of_the_wrong_type": ("json", 0, 1, "tokens", [4, "x"], "invalid_type"),
    "length_mismatch": ("json", 0, 1, "logprobs", [-0.4], "length_mismatch"),
    "unknown_field": ("json", 0, 0, "advantage", 1.0, "unknown_field"),
    "arrow_nan_reward": ("arrow", 1, 1, "reward", float("nan"), "invalid_value"),
    "arrow_length_mismatch": ("arrow", 1, 1, "logprobs", [-0.7], "length_mismatch"),
}


@pytest.mark.parametrize("case", list(ROLLOUT_CHANGES))
def test_a_wrong_rollout_value_names_group_rollout_and_field(server: Server, case: str) -> None:
    wire, group, rollout, field, value, code = ROLLOUT_CHANGES[case]
    path = ("groups", group, "rollouts", rollout, field)
    request = with_change(path, value, delete=value is DELETE)
    if wire == "arrow":
        response = post_text(server, arrow_request(request), ARROW)
    else:
        response = server.client.post("/v1/advantages", json=request)
    expect_error(response, 422, code, field, f"p{group}", rollout)


# The estimator of small_request() replaced -> (code, field) of the error.
ESTIMATOR_CHANGES: dict[str, tuple[Any, str, str]] = {
    "unknown_estimator": ("grpo2", "unknown_estimator", "estimator"),
    "unknown_parameter": (
        {"outcome": {"name": "grpo", "temperature": 1.0}},
        "unknown_parameter",
        "estimator.outcome.temperature",
    ),
    "out_of_range_parameter": (
        {"outcome": "grpo", "ktae": {"tf_b": 1.5}},
        "out_of_range",
        "estimator.ktae.tf_b",
    ),
    "missing_teacher_for_cscr": ("cscr", "missing_input", "teacher_logprobs.pos"),
}


@pytest.mark.parametrize("case", list(ESTIMATOR_CHANGES))
def test_a_wrong_estimator_is_422_naming_the_parameter(server: Server, case: str) -> None:
    estimator, code, field = ESTIMATOR_CHANGES[case]
    request = with_change(("estimator",), estimator)
    expect_error(server.client.post("/v1/advantages", json=request), 422, code, field)


def test_nan_reward_is_422_invalid_value(server: Server) -> None:
    # Python's JSON parser accepts the NaN literal; the service must still refuse it.
    body = json.dumps(small_request()).replace('"reward": 0.5', '"reward": NaN')
    expect_error(post_text(server, body), 422, "invalid_value", "reward", "p1", 0)


def test_nan_logprob_is_422_invalid_value(server: Server) -> None:
    body = json.dumps(small_request()).replace("-0.5]", "NaN]")
    expect_error(post_text(server, body), 422, "invalid_value", "logprobs", "p0", 1)


def test_huge_numbers_are_422_not_a_crash(server: Server) -> None:
    group = '{"groups": [{"id": "a", "rollouts": [{"tokens": [%s], "reward": %s}]}]'
    for body in (
        group % ("1", "1" + "0" * 400) + "}",  # a reward too large for a float
        group % ("1" + "0" * 30, "1") + "}",  # a token id too large for int64
        group % ("1" + "0" * 5000, "1") + "}",  # more digits than Python parses
        '{"estimator": "ktae", "ignore_token_ids": [1'
        + "0" * 30
        + "], "
        + group[1:] % (1, 1)
        + "}",
    ):
        response = post_text(server, body)
        assert response.status_code == 422, (body[:80], response.text)


def test_huge_integer_parameter_is_422(server: Server) -> None:
    estimator = '{"outcome": {"name": "grpo", "epsilon": 1' + "0" * 400 + "}}"
    body = '{"estimator": ' + estimator + ', "groups": []}'
    expect_error(post_text(server, body), 422, "out_of_range", "estimator.outcome.epsilon")


# ---- Arrow --------------------------------------------------------------------------------------


def test_garbage_arrow_is_422_invalid_arrow(server: Server) -> None:
    expect_error(post_text(server, b"\x00not arrow at all", ARROW), 422, "invalid_arrow", None)


def test_arrow_without_tokens_column_is_422_invalid_arrow(server: Server) -> None:
    table = pa.table({"group_id": ["a"], "reward": [1.0]})
    expect_error(post_text(server, stream_bytes(table), ARROW), 422, "invalid_arrow", "tokens")


def test_arrow_float_tokens_are_422_invalid_type(server: Server) -> None:
    table = pa.table(
        {"group_id": ["a"], "reward": [1.0], "tokens": pa.array([[1.5]], pa.list_(pa.float32()))}
    )
    expect_error(post_text(server, stream_bytes(table), ARROW), 422, "invalid_type", "tokens")


def test_arrow_bad_metadata_is_422(server: Server) -> None:
    table = pa.table(
        {"group_id": ["a"], "reward": [1.0], "tokens": pa.array([[1]], pa.list_(pa.int32()))}
    ).replace_schema_metadata({"advantage.request": '{"estimator": "nope"}'})
    expect_error(
        post_text(server, stream_bytes(table), ARROW), 422, "unknown_estimator", "estimator"
    )


# ---- 415, 413, 404 ------------------------------------------------------------------------------


def test_unknown_content_type_is_415(server: Server) -> None:
    response = post_text(server, json.dumps(small_request()), "application/x-www-form-urlencoded")
    expect_error(response, 415, "unsupported_media_type", "Content-Type")


def one_group_request(tokens: int, rollouts: int = 2) -> dict[str, Any]:
    per = [tokens // rollouts + (1 if i < tokens % rollouts else 0) for i in range(rollouts)]
    return {
        "groups": [
            {
                "id": "big",
                "rollouts": [
                    {"tokens": [1] * n, "reward": float(i % 2)} for i, n in enumerate(per)
                ],
            }
        ]
    }


def test_token_limit_is_413_just_above_and_200_at_it(server: Server) -> None:
    limit = SHARED_SETTINGS["max_request_tokens"]
    at = server.client.post("/v1/advantages", json=one_group_request(limit))
    assert at.status_code == 200, at.text
    assert at.json()["summary"]["tokens"] == limit
    over = server.client.post("/v1/advantages", json=one_group_request(limit + 1))
    error = expect_error(over, 413, "limit_exceeded", "tokens")
    assert str(limit) in error["message"]


def test_token_limit_applies_to_arrow_too(server: Server) -> None:
    limit = SHARED_SETTINGS["max_request_tokens"]
    response = post_text(server, arrow_request(one_group_request(limit + 1)), ARROW)
    expect_error(response, 413, "limit_exceeded", "tokens")


def test_group_size_limit_is_413_naming_the_group(server: Server) -> None:
    limit = SHARED_SETTINGS["max_group_size"]
    at = server.client.post("/v1/advantages", json=one_group_request(limit, rollouts=limit))
    assert at.status_code == 200, at.text
    over = server.client.post("/v1/advantages", json=one_group_request(limit + 1, limit + 1))
    expect_error(over, 413, "limit_exceeded", "rollouts", group_id="big")


def test_body_limit_is_413_from_content_length(server: Server) -> None:
    limit = SHARED_SETTINGS["max_body_bytes"]
    body = b" " * (limit + 1)
    expect_error(post_text(server, body), 413, "limit_exceeded", "body")


def test_body_limit_is_413_for_a_chunked_body_without_length(server: Server) -> None:
    limit = SHARED_SETTINGS["max_body_bytes"]

    def chunks() -> Any:
        for _ in range(limit // 65536 + 2):
            yield b" " * 65536

    response = server.client.post(
        "/v1/advantages", content=chunks(), headers={"content-type": "application/json"}
    )
    expect_error(response, 413, "limit_exceeded", "body")


def test_unknown_path_is_404_in_the_error_shape(server: Server) -> None:
    expect_error(server.client.get("/v2/advantages"), 404, "not_found", None)


def test_errors_never_reached_the_internal_error_handler(server: Server) -> None:
    # Runs after the tests above (pytest keeps file order): none of them was counted as a 500
    # except the one known, marked case.
    samples = server.metrics()
    internal = sum(
        v
        for (name, labels), v in samples.items()
        if name == "advantage_requests_total" and dict(labels)["code"] == "500"
    )
    assert internal <= 1, internal


def test_random_requests_are_valid(server: Server) -> None:
    # The builders above are honest: an unchanged request is accepted.
    assert server.client.post("/v1/advantages", json=small_request()).status_code == 200
    assert post_text(server, arrow_request(random_request(5)), ARROW).status_code == 200


def _post_raw(server: Server, body: bytes, declared: int | None = None) -> tuple[int, bytes]:
    """POST ``body`` over a raw socket, all of it sent before the answer is read (as most
    clients do); (status, answer body). A reset while sending fails the test."""
    import socket

    length = len(body) if declared is None else declared
    head = (
        "POST /v1/advantages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(head + body)
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
            if b"\r\n\r\n" in data:
                header, _, rest = data.partition(b"\r\n\r\n")
                size = int(
                    next(
                        line.split(b":")[1]
                        for line in header.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    )
                )
                if len(rest) >= size:
                    return int(header.split()[1]), rest[:size]
    raise AssertionError(f"no complete answer: {data[:200]!r}")


def test_a_client_still_sending_an_oversized_body_reads_the_413_not_a_reset(
    server: Server,
) -> None:
    """The limit is refused from Content-Length before the body is read; the service reads and
    drops the rest (bounded) so that the client, which sends it all before reading, gets the
    answer. 20x the body limit of the shared server."""
    limit = SHARED_SETTINGS["max_body_bytes"]
    status, answer = _post_raw(server, b" " * (20 * limit))
    assert status == 413
    error = json.loads(answer)["error"]
    assert error["code"] == "limit_exceeded" and error["field"] == "body"
    # The service is still there for the next client.
    assert server.client.get("/healthz").status_code == 200


def test_deeply_nested_json_in_the_arrow_metadata_is_422_not_a_crash(server: Server) -> None:
    # (under a known field: the metadata is checked as a JSON body is, and an unknown field is
    # refused before its value is read)
    deep = '{"namespace":' + "[" * 100_000 + "1" + "]" * 100_000 + "}"
    table = pa.table({"group_id": ["g"], "reward": [1.0], "tokens": [[1, 2]]})
    table = table.replace_schema_metadata({"advantage.request": deep})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    answer = server.client.post(
        "/v1/advantages",
        content=sink.getvalue().to_pybytes(),
        headers={"content-type": "application/vnd.apache.arrow.stream"},
    )
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["code"] == "invalid_json"


def test_an_arrow_stream_cut_short_or_followed_by_garbage_is_422(server: Server) -> None:
    """A truncated upload must not be computed as if it were whole: the end-of-stream marker
    must be there, and nothing after it."""
    table = pa.table({"group_id": ["g", "g"], "reward": [1.0, 0.0], "tokens": [[1, 2], [3]]})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    whole = sink.getvalue().to_pybytes()
    ok = post_text(server, whole, ARROW)
    assert ok.status_code == 200, ok.text
    for body, why in ((whole[:-8], "end-of-stream"), (whole + b"trailing", "after")):
        error = expect_error(post_text(server, body, ARROW), 422, "invalid_arrow", None)
        assert why in error["message"]
