"""The viewer's page and routes over HTTP (no browser): served from the package, the same
auth as the API, requests kept per namespace (bounded in count and bytes), token text."""

from __future__ import annotations

import re

import httpx
import pytest
from advantage_service.viewer.routes import RecentRequests
from integration.http_support import ARROW, Server, arrow_request
from viewer.conftest import KEEP, WORDS
from viewer.viewer_support import kept, ktae_request

AUTH = {"Authorization": "Bearer viewer-secret"}
OTHER = {"Authorization": "Bearer other-secret"}


def test_viewer_page_needs_nothing_from_outside(viewer_server: Server) -> None:
    client = viewer_server.client
    page = client.get("/viewer")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert assets and all(a.startswith(("/", "data:")) for a in assets), assets
    for asset in (a for a in assets if a.startswith("/viewer/static/")):
        answer = client.get(asset)
        assert answer.status_code == 200 and len(answer.content) > 500, asset
    config = client.get("/viewer/api/config").json()
    assert config["auth"] is True and config["keep"] == KEEP and config["tokenizer"]


def test_viewer_routes_take_the_apis_auth(viewer_server: Server) -> None:
    client = viewer_server.client
    assert client.get("/viewer/api/recent", params={"namespace": "team-a"}).status_code == 401
    denied = client.get("/viewer/api/recent", params={"namespace": "team-a"}, headers=OTHER)
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "permission_denied"
    request = ktae_request("routes-1")
    assert client.post("/v1/advantages", json=request, headers=AUTH).status_code == 200
    kept = client.get(
        "/viewer/api/requests/routes-1", params={"namespace": "team-a"}, headers=OTHER
    )
    assert kept.status_code == 403


def test_requests_are_kept_per_namespace_and_reopen_as_computed(viewer_server: Server) -> None:
    client = viewer_server.client
    request = ktae_request("routes-2", seed=2)
    answer = client.post("/v1/advantages", json=request, headers=AUTH).json()
    listing = client.get("/viewer/api/recent", params={"namespace": "team-a"}, headers=AUTH)
    assert listing.json()["requests"][0]["request_id"] == "routes-2"
    kept = client.get(
        "/viewer/api/requests/routes-2", params={"namespace": "team-a"}, headers=AUTH
    ).json()
    assert kept["response"] == answer
    rollouts = [r for g in kept["request"]["groups"] for r in g["rollouts"]]
    assert [r["tokens"] for r in rollouts] == [
        r["tokens"] for g in request["groups"] for r in g["rollouts"]
    ]
    missing = client.get("/viewer/api/requests/nope", params={"namespace": "team-a"}, headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["field"] == "request_id"
    for i in range(KEEP + 2):
        client.post("/v1/advantages", json=ktae_request(f"routes-many-{i}"), headers=AUTH)
    listed = client.get("/viewer/api/recent", params={"namespace": "team-a"}, headers=AUTH)
    ids = [r["request_id"] for r in listed.json()["requests"]]
    assert len(ids) == KEEP and ids[0] == f"routes-many-{KEEP + 1}"


def test_token_text_comes_from_the_local_tokenizer(viewer_server: Server) -> None:
    client = viewer_server.client
    texts = client.post("/viewer/api/token-text", json={"ids": [1, 2, 5, 9999]}, headers=AUTH)
    assert texts.json()["texts"] == {"1": WORDS[1], "2": WORDS[2], "5": WORDS[5], "9999": ""}
    assert client.post("/viewer/api/token-text", json={"ids": [1]}).status_code == 401
    bad = client.post("/viewer/api/token-text", json={"ids": ["x"]}, headers=AUTH)
    assert bad.status_code == 422


def test_diagnostics_route_lists_what_the_estimator_returns(viewer_server: Server) -> None:
    got = viewer_server.client.post(
        "/viewer/api/diagnostics", json={"estimator": {"outcome": "rloo", "cscr": {}}}, headers=AUTH
    )
    assert got.json()["diagnostics"] == ["scalar", "cscr_weight", "sensitivity"]
    bad = viewer_server.client.post(
        "/viewer/api/diagnostics", json={"estimator": "nope"}, headers=AUTH
    )
    assert bad.status_code == 422


def test_recent_requests_are_bounded_in_count_and_bytes() -> None:
    recent = RecentRequests(per_namespace=3, max_bytes=9_000)
    for i in range(5):
        assert recent.add(kept("a", f"r{i}", 100))
    assert [k.request_id for k in recent.recent("a")] == ["r4", "r3", "r2"]
    assert recent.add(kept("b", "big", 2000))  # 8 kB: the oldest of any namespace leave
    assert recent.nbytes <= 9_000
    assert recent.get("b", "big") is not None and recent.get("a", "r2") is None
    assert not recent.add(kept("b", "huge", 5000))  # 20 kB alone: not kept
    assert RecentRequests(0, 10_000).add(kept("a", "off", 1)) is False
    recent.add(kept("a", "r4", 10))  # the same id again replaces it
    assert [k.request_id for k in recent.recent("a")].count("r4") == 1


@pytest.mark.parametrize("path", ["/viewer/api/recent?namespace=team-a", "/viewer"])
def test_root_and_viewer_answer_without_holding_the_connection(
    viewer_server: Server, path: str
) -> None:
    with httpx.Client(base_url=viewer_server.url, timeout=5.0) as client:
        answer = client.get(path, headers=AUTH)
        assert answer.status_code == 200
        assert "text/event-stream" not in answer.headers.get("content-type", "")


def test_a_request_answered_in_arrow_is_kept_as_its_json_answer(viewer_server: Server) -> None:
    client = viewer_server.client
    request = ktae_request("routes-arrow", seed=4)
    body = arrow_request(request)
    answer = client.post(
        "/v1/advantages",
        content=body,
        headers={**AUTH, "Content-Type": ARROW, "Accept": ARROW},
    )
    assert answer.status_code == 200 and answer.headers["content-type"] == ARROW
    kept = client.get(
        "/viewer/api/requests/routes-arrow", params={"namespace": "team-a"}, headers=AUTH
    ).json()
    as_json = client.post(
        "/v1/advantages", json={**request, "request_id": "routes-arrow-json"}, headers=AUTH
    ).json()
    assert kept["response"]["groups"] == as_json["groups"]
