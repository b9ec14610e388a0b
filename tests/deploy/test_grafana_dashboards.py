"""The Grafana dashboards: well-formed, filtered by the namespace/job variables, reading only
metrics the service exports, and every panel explained in docs/deploy.md. (That every panel
query returns data from a real Prometheus is tests/deploy/test_observability_live.py.)"""

from __future__ import annotations

from typing import Any

import pytest
from advantage_service.observability.metrics import Metrics
from deploy_support import (
    DOCS,
    dashboards,
    metric_names,
    panel_queries,
    panel_query_id,
    panels,
    unknown_metrics,
)

DASHBOARDS = dashboards()
# What the issue asks each dashboard to show, as metrics its queries must read.
REQUIRED_METRICS = {
    "service-health": {
        "advantage_requests_total",  # rate, errors
        "advantage_request_errors_total",  # overload refusals (503 overloaded)
        "advantage_request_duration_seconds_bucket",  # latency percentiles
        "advantage_queue_depth",  # saturation: the queue against its capacity
        "advantage_max_queue",
        "advantage_queue_wait_seconds_bucket",
        "advantage_batch_requests_sum",  # requests per computation
        "advantage_batch_requests_count",
        "advantage_batch_requests_bucket",
        "advantage_stats_store_up",  # store health
        "advantage_stats_store_errors_total",
        "advantage_stats_store_duration_seconds_bucket",
    },
    "training-health": {
        "advantage_tokens_total",  # tokens/s, KTAE/CSCR activity
        "advantage_groups_total",  # zero-signal group ratio
        "advantage_group_accuracy_bucket",  # group accuracy distribution
        "advantage_token_advantage_bucket",  # token-advantage distribution
        "advantage_compute_duration_seconds_bucket",
    },
}


def test_the_two_dashboards_exist_with_unique_uids() -> None:
    assert set(DASHBOARDS) == set(REQUIRED_METRICS)
    uids = [d["uid"] for d in DASHBOARDS.values()]
    assert len(set(uids)) == len(uids)
    for dashboard in DASHBOARDS.values():
        assert dashboard["id"] is None, "an exported id collides on import"
        assert dashboard["schemaVersion"] >= 36


@pytest.mark.parametrize("stem", sorted(DASHBOARDS))
def test_panels_have_unique_ids_and_do_not_overlap(stem: str) -> None:
    dashboard = DASHBOARDS[stem]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(set(ids)) == len(ids)
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


@pytest.mark.parametrize("stem", sorted(DASHBOARDS))
def test_variables_select_the_datasource_namespace_and_job(stem: str) -> None:
    variables = {v["name"]: v for v in DASHBOARDS[stem]["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("namespace", "job"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"]["uid"] == "${datasource}"
    for panel in panels(DASHBOARDS[stem]):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(set(refs)) == len(refs), panel["title"]


@pytest.mark.parametrize(
    ("stem", "title", "ref", "expr"),
    panel_queries(),
    ids=[panel_query_id(q) for q in panel_queries()],
)
def test_every_panel_query_filters_by_namespace_and_job(
    stem: str, title: str, ref: str, expr: str
) -> None:
    # Every selector, not just one: a bare selector would mix in other deployments.
    selectors = expr.count("{")
    assert selectors, title
    assert expr.count('namespace=~"$namespace"') == selectors, title
    assert expr.count('job=~"$job"') == selectors, title


def test_every_metric_a_panel_reads_is_exported_by_the_service() -> None:
    exposition = Metrics().render().decode()
    for stem, title, ref, expr in panel_queries():
        assert not unknown_metrics(expr, exposition), f"{stem} / {title} / {ref}"


@pytest.mark.parametrize("stem", sorted(REQUIRED_METRICS))
def test_dashboards_show_what_the_issue_asks(stem: str) -> None:
    read = {name for s, _, _, expr in panel_queries() if s == stem for name in metric_names(expr)}
    assert REQUIRED_METRICS[stem] <= read


def _described(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["title"], p["description"]) for p in panels(dashboard)]


@pytest.mark.parametrize("stem", sorted(DASHBOARDS))
def test_every_panel_is_explained_in_the_deploy_docs(stem: str) -> None:
    docs = DOCS.read_text()
    assert DASHBOARDS[stem]["title"] in docs
    for title, description in _described(DASHBOARDS[stem]):
        assert description, f"{title} has no description"
        assert f"| {title} | {description} |" in docs, f"{title} is not in docs/deploy.md"
