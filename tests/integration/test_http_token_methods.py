"""The token-level methods (forking tokens, OTB, GTPO, GRPO-S, HICRA; MaxRL beside them) over
HTTP against a real server: entropy, sum_pi_squared, is_weights and planning_mask as JSON fields
and as Arrow columns give the in-process numbers, every request error they add is a 422 naming
group, rollout and field in both encodings, and GET /v1/estimators lists the inputs each method
needs."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from advantage_service import compute
from http_support import ARROW, Server, arrow_request, random_request, read_arrow, stream_bytes
from token_cases import ERROR_CASES, ERROR_IDS, check_listing

pytestmark = pytest.mark.integration

ESTIMATORS = [
    "otb",
    "forking",
    {"outcome": "otb", "cscr": {}, "forking": {"rho": 0.5}, "whiten": True},
    {"outcome": "rloo", "ktae": {}, "forking": {"scope": "group", "rho": 1.0}},
    "maxrl",
    "gtpo",
    "grpo_s",
    "hicra",
    {"outcome": "gtpo", "ktae": {}, "hicra": {"alpha": 0.5}, "forking": {}, "clip": 1.0},
    {"outcome": "maxrl", "cscr": {}, "hicra": {}, "whiten": True},
    {"outcome": "grpo_s", "opsd": {}, "hicra": {}},
]
IDS = ["otb", "forking", "otb+cscr+forking+whiten", "rloo+ktae+forking(group, rho=1)"]
IDS += ["maxrl", "gtpo", "grpo_s", "hicra", "gtpo+ktae+hicra+forking+clip"]
IDS += ["maxrl+cscr+hicra+whiten", "grpo_s+opsd+hicra"]
PER_TOKEN = ("logprobs", "entropy", "sum_pi_squared", "is_weights", "planning_mask")


def rows_of(response_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for g in response_groups for r in g["rollouts"]]


@pytest.mark.parametrize("index", range(len(ESTIMATORS)), ids=IDS)
def test_json_and_arrow_give_the_in_process_numbers(server: Server, index: int) -> None:
    request = random_request(seed=30 + index, estimator=ESTIMATORS[index])
    want = rows_of(compute(request, device="cpu")["groups"])

    as_json = server.client.post("/v1/advantages", json=request)
    assert as_json.status_code == 200, as_json.text
    as_arrow = server.client.post(
        "/v1/advantages",
        content=arrow_request(request),
        headers={"content-type": ARROW, "accept": ARROW},
    )
    assert as_arrow.status_code == 200, as_arrow.text
    _, table = read_arrow(as_arrow.content)
    via_arrow = table.to_pylist()  # rows in request order
    for got_json, got_arrow, expected in zip(
        rows_of(as_json.json()["groups"]), via_arrow, want, strict=True
    ):
        for key, value in expected.items():
            np.testing.assert_array_equal(np.asarray(got_json[key], np.float32), value, key)
            np.testing.assert_array_equal(np.asarray(got_arrow[key], np.float32), value, key)


def arrow_body(request: dict[str, Any]) -> bytes:
    """The request as Arrow rows; a per-token field some rollouts lack is a null row there,
    one no rollout has is no column."""
    rows = [(g["id"], r) for g in request["groups"] for r in g["rollouts"]]
    columns: dict[str, pa.Array] = {
        "group_id": pa.array([gid for gid, _ in rows], pa.string()),
        "reward": pa.array([r["reward"] for _, r in rows], pa.float64()),
        "tokens": pa.array([r["tokens"] for _, r in rows], pa.list_(pa.int32())),
    }
    for name in PER_TOKEN:
        if any(name in r for _, r in rows):
            columns[name] = pa.array([r.get(name) for _, r in rows], pa.list_(pa.float32()))
    options = {k: v for k, v in request.items() if k != "groups"}
    table = pa.table(columns).replace_schema_metadata({"advantage.request": json.dumps(options)})
    return stream_bytes(table)


@pytest.mark.parametrize("case", ERROR_CASES, ids=ERROR_IDS)
def test_every_error_is_a_422_naming_group_rollout_and_field(server: Server, case: Any) -> None:
    request = case.request()
    for body, content_type in (
        # (NaN and infinity: JSON as Python writes and reads it)
        (json.dumps(request).encode(), "application/json"),
        (arrow_body(request), ARROW),
    ):
        response = server.client.post(
            "/v1/advantages", content=body, headers={"content-type": content_type}
        )
        assert response.status_code == 422, (content_type, response.text)
        error = response.json()["error"]
        located = (error["code"], error["group_id"], error["rollout_index"], error["field"])
        assert located == case.expected, content_type


def test_unknown_arrow_column_lists_the_per_token_columns(server: Server) -> None:
    table = pa.table(
        {
            "group_id": pa.array(["g"], pa.string()),
            "reward": pa.array([1.0]),
            "tokens": pa.array([[1]], pa.list_(pa.int32())),
            "entropies": pa.array([[0.5]], pa.list_(pa.float32())),
        }
    )
    response = server.client.post(
        "/v1/advantages", content=stream_bytes(table), headers={"content-type": ARROW}
    )
    assert response.status_code == 422
    error = response.json()["error"]
    assert (error["code"], error["field"]) == ("unknown_field", "entropies")
    assert "entropy" in error["message"] and "sum_pi_squared" in error["message"]


def test_estimators_listing_names_each_methods_inputs(server: Server) -> None:
    check_listing(server.client.get("/v1/estimators").json())
