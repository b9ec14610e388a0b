"""The real server over real sockets gives exactly the in-process API's numbers, in JSON and in
Arrow, for every preset; and its listing, health and OpenAPI endpoints say what they should."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pytest
from advantage_service import compute, presets, resolve_estimator
from advantage_service.estimators import OUTCOMES, TERMS
from advantage_service.wire import jsonio
from http_support import ALL_PRESETS, ARROW, Server, arrow_request, random_request, read_arrow

pytestmark = pytest.mark.integration


def assert_same_groups(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [g["id"] for g in got] == [g["id"] for g in want]
    for g_got, g_want in zip(got, want, strict=True):
        assert len(g_got["rollouts"]) == len(g_want["rollouts"]), g_want["id"]
        for i, (r_got, r_want) in enumerate(
            zip(g_got["rollouts"], g_want["rollouts"], strict=True)
        ):
            assert set(r_got) == set(r_want), (g_want["id"], i)
            for key, value in r_want.items():
                # Bit-identical: float32 values survive JSON's shortest-repr round trip exactly.
                np.testing.assert_array_equal(
                    np.asarray(r_got[key], dtype=np.float32),
                    np.asarray(value, dtype=np.float32),
                    err_msg=f"group {g_want['id']} rollout {i} field {key}",
                )


@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_json_response_equals_in_process_api(server: Server, preset: str) -> None:
    request = random_request(seed=len(preset), estimator=preset)
    want = compute(request, device="cpu")
    response = server.client.post("/v1/advantages", json=request)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    got = response.json()
    assert got["request_id"] == request["request_id"]
    assert got["namespace"] == "default"
    assert got["estimator"] == want["estimator"]
    assert_same_groups(got["groups"], want["groups"])
    summary = got["summary"]
    assert {k: summary[k] for k in ("tokens", "rollouts", "groups", "zero_signal_groups")} == {
        k: want["summary"][k] for k in ("tokens", "rollouts", "groups", "zero_signal_groups")
    }
    assert summary["device"] == "cpu"
    assert summary["history"] == "none"
    assert summary["recorded"] is True and want["summary"]["recorded"] is None


def arrow_rows_as_groups(table: Any) -> list[dict[str, Any]]:
    """The Arrow response table regrouped into the JSON response's groups (by group_id and
    rollout_index), so one comparison serves both formats."""
    rows = table.to_pylist()
    groups: dict[str, dict[int, dict[str, Any]]] = {}
    for row in rows:
        fields = {k: v for k, v in row.items() if k not in ("group_id", "rollout_index")}
        groups.setdefault(row["group_id"], {})[row["rollout_index"]] = fields
    return [
        {"id": gid, "rollouts": [members[i] for i in range(len(members))]}
        for gid, members in groups.items()
    ]


@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_arrow_response_equals_in_process_api(server: Server, preset: str) -> None:
    request = random_request(seed=100 + len(preset), estimator=preset)
    want = compute(request, device="cpu")
    response = server.client.post(
        "/v1/advantages",
        content=arrow_request(request),
        headers={"content-type": ARROW, "accept": ARROW},
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == ARROW
    meta, table = read_arrow(response.content)
    assert meta["request_id"] == request["request_id"]
    assert meta["estimator"] == want["estimator"]
    assert meta["summary"]["tokens"] == want["summary"]["tokens"]
    assert meta["summary"]["recorded"] is True
    assert table.schema.field("advantages").type.value_type == "float"
    assert table.num_rows == sum(len(g["rollouts"]) for g in request["groups"])
    # Arrow always carries the scalar; the in-process answer has it because it was asked for.
    assert_same_groups(arrow_rows_as_groups(table), want["groups"])


def test_arrow_request_with_json_response_equals_json_request(server: Server) -> None:
    request = random_request(seed=7, estimator="ktae")
    as_json = server.client.post("/v1/advantages", json=request).json()
    as_arrow = server.client.post(
        "/v1/advantages", content=arrow_request(request), headers={"content-type": ARROW}
    )
    assert as_arrow.status_code == 200, as_arrow.text
    assert as_arrow.headers["content-type"] == "application/json"
    assert_same_groups(as_arrow.json()["groups"], as_json["groups"])


def test_arrow_rows_of_a_group_need_not_be_contiguous(server: Server) -> None:
    request = random_request(seed=11, estimator="ktae", groups=3)
    n = sum(len(g["rollouts"]) for g in request["groups"])
    order = list(np.random.default_rng(0).permutation(n))
    response = server.client.post(
        "/v1/advantages",
        content=arrow_request(request, order=order),
        headers={"content-type": ARROW, "accept": ARROW},
    )
    assert response.status_code == 200, response.text
    _, table = read_arrow(response.content)
    # Rows come back in request order, each naming its group and its rank within the group.
    flat = [(g["id"], i) for g in request["groups"] for i in range(len(g["rollouts"]))]
    want_rows = [flat[i] for i in order]
    got_rows = list(
        zip(table["group_id"].to_pylist(), table["rollout_index"].to_pylist(), strict=True)
    )
    # rollout_index counts a group's rows in the order they were sent.
    rank: dict[str, int] = {}
    expected = []
    for gid, _ in want_rows:
        expected.append((gid, rank.get(gid, 0)))
        rank[gid] = rank.get(gid, 0) + 1
    assert got_rows == expected
    # Same numbers as the contiguous request, rollout for rollout.
    want = compute(request, device="cpu")
    by_origin = {want_rows[row]: table["advantages"][row].as_py() for row in range(table.num_rows)}
    for g in want["groups"]:
        for i, rollout in enumerate(g["rollouts"]):
            np.testing.assert_array_equal(
                np.asarray(by_origin[(g["id"], i)], dtype=np.float32), rollout["advantages"]
            )


def test_accept_prefers_arrow_only_when_ranked_higher(server: Server) -> None:
    request = random_request(seed=3)
    for accept, expected in [
        (None, "application/json"),
        ("*/*", "application/json"),
        (ARROW, ARROW),
        (f"application/json;q=0.5, {ARROW}", ARROW),
        (f"{ARROW};q=0.2, application/json", "application/json"),
        # q=0 rules a type out, whatever a wildcard allows; a q past 1 is no q.
        ("application/json;q=0, */*", ARROW),
        (f"{ARROW};q=0, */*", "application/json"),
        (f"{ARROW};q=2, application/json;q=0.5", "application/json"),
        (f"{ARROW};q=inf, application/json;q=0.5", "application/json"),
    ]:
        headers = {} if accept is None else {"accept": accept}
        response = server.client.post("/v1/advantages", json=request, headers=headers)
        assert response.status_code == 200
        assert response.headers["content-type"] == expected, accept


def test_estimators_listing_is_generated_from_the_registry(server: Server) -> None:
    response = server.client.get("/v1/estimators")
    assert response.status_code == 200
    listing = response.json()
    assert set(listing["presets"]) == set(presets())
    assert listing["presets"]["ktae"] == resolve_estimator("ktae").to_dict()
    assert [o["name"] for o in listing["outcomes"]] == list(OUTCOMES)
    assert [t["name"] for t in listing["terms"]] == list(TERMS)
    ktae = next(t for t in listing["terms"] if t["name"] == "ktae")
    tf_b = next(p for p in ktae["parameters"] if p["name"] == "tf_b")
    assert (tf_b["default"], tf_b["minimum"], tf_b["maximum"]) == (0.5, 0.0, 1.0)
    grpo = next(o for o in listing["outcomes"] if o["name"] == "grpo")
    assert {p["name"] for p in grpo["parameters"]} == {
        "norm_by_std",
        "epsilon",
        "std_scope",
        "mean_scope",
        "leave_one_out",
        "std_unbiased",
        "std_center",
        "zero_signal",
    }
    assert "ktae_score" in ktae["diagnostics"]
    assert {p["name"] for p in listing["options"]} == {"whiten", "clip"}


def test_health_and_readiness(server: Server) -> None:
    assert server.client.get("/healthz").json() == {"status": "ok"}
    ready = server.client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"ready": True, "stats_store": "memory"}


def test_openapi_documents_real_request_and_response_schemas(server: Server) -> None:
    spec = server.client.get("/openapi.json").json()
    operation = spec["paths"]["/v1/advantages"]["post"]
    content = operation["requestBody"]["content"]
    assert set(content) == {"application/json", ARROW}
    request_schema = spec["components"]["schemas"]["AdvantageRequest"]
    assert request_schema["required"] == ["groups"]
    estimator = request_schema["properties"]["estimator"]
    preset_enum = next(s for s in estimator["anyOf"] if s.get("type") == "string")["enum"]
    assert set(preset_enum) == set(presets())
    # The documented example is a real answer to the documented example request.
    example_request = content["application/json"]["example"]
    example_response = operation["responses"]["200"]["content"]["application/json"]["example"]
    want = json.loads(jsonio.dumps(compute(example_request, device="cpu")))
    assert_same_groups(example_response["groups"], want["groups"])
    for status in ("200", "413", "415", "422", "503"):
        assert status in operation["responses"], status
    assert "Retry-After" in operation["responses"]["503"]["headers"]
    docs = server.client.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


def test_docs_need_nothing_from_outside_the_service(server: Server) -> None:
    """/docs works on an air-gapped cluster: every script, stylesheet and image the page loads
    is served by the service itself; / leads a person to the viewer, which links them."""
    page = server.client.get("/docs").text
    assets = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert assets and all(a.startswith("/") for a in assets), assets
    for asset in assets:
        answer = server.client.get(asset)
        assert answer.status_code == 200 and len(answer.content) > 100, asset
    bundle = next(a for a in assets if a.endswith("swagger-ui-bundle.js"))
    assert b"SwaggerUIBundle" in server.client.get(bundle).content
    assert "/openapi.json" in page
    start = server.client.get("/", follow_redirects=False)
    assert start.status_code in (302, 307) and start.headers["location"] == "/viewer"
    assert 'href="/docs"' in server.client.get("/viewer").text
