"""The dashboards and alerts against the real thing: a ``prometheus`` server (OS package) scrapes
a real service (its stats store on a throwaway redis-server) on loopback once a second while the
test sends it traffic (computed requests with and without signal, KTAE/CSCR/OPSD, KTAE history,
invalid requests, a burst past the queue, partly refused 503 overloaded); then every dashboard
panel query must return data through Prometheus's HTTP API, every alert expression must
evaluate, and Prometheus must have loaded and evaluated the rule file itself."""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from deploy_support import (
    ALERTS,
    GRAFANA_VARIABLES,
    alert_rules,
    dashboards,
    panel_queries,
    panel_query_id,
    substitute,
    unknown_metrics,
)
from process_support import free_port
from process_support import poll as wait_for
from stats.redis_support import RedisServer

pytestmark = pytest.mark.integration

STARTUP_SECONDS = 120.0
JOB = GRAFANA_VARIABLES["job"]
NAMESPACE = GRAFANA_VARIABLES["namespace"]


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.TransportError:
        return False


@dataclass
class Stack:
    service: str
    prometheus: str
    sent: dict[str, int]

    def query(self, expr: str) -> dict[str, Any]:
        """An instant query; the API's JSON answer (status success or error)."""
        response = httpx.get(f"{self.prometheus}/api/v1/query", params={"query": expr}, timeout=30)
        return dict(response.json())

    def scalar(self, expr: str) -> float:
        answer = self.query(expr)
        assert answer["status"] == "success", answer
        (sample,) = answer["data"]["result"]
        return float(sample["value"][1])


# ---- processes ----------------------------------------------------------------------------------


def start_service(directory: Path, redis_url: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADV_")}
    # One compute worker and room for three requests: a small concurrent burst waits in the
    # queue (queue panels), may be merged (requests per computation) and is partly refused
    # 503 overloaded (overload panels).
    env["ADV_MAX_INFLIGHT"] = "1"
    env["ADV_MAX_QUEUE"] = "3"
    env["ADV_REDIS_URL"] = redis_url
    log = (directory / "service.log").open("wb")
    # fmt: off
    process = subprocess.Popen(
        [sys.executable, "-m", "advantage_service", "serve", "--host", "127.0.0.1",
         "--http-port", str(port), "--grpc-port", str(free_port()), "--device", "cpu",
         "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    # fmt: on
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if process.poll() is not None:
            raise AssertionError(
                f"the service exited with {process.returncode}:\n"
                + (directory / "service.log").read_text(errors="replace")
            )
        return answers(url + "/readyz")

    try:
        wait_for(ready, STARTUP_SECONDS, "the service's /readyz")
    except BaseException:
        stop(process)
        raise
    return process, url


def start_prometheus(directory: Path, target: str) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("prometheus")
    assert binary
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [
            {
                "job_name": JOB,
                "static_configs": [{"targets": [target], "labels": {"namespace": NAMESPACE}}],
            }
        ],
    }
    (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (directory / "prometheus.log").open("wb")
    # fmt: off
    process = subprocess.Popen(
        [binary, f"--config.file={directory / 'prometheus.yml'}",
         f"--storage.tsdb.path={directory / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
         "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    # fmt: on
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: process.poll() is None and answers(url + "/-/ready"), 30, "prometheus")
    except AssertionError as exc:
        stop(process)
        log = (directory / "prometheus.log").read_text(errors="replace")
        raise AssertionError(f"prometheus did not start:\n{log}") from exc
    return process, url


# ---- traffic ------------------------------------------------------------------------------------


def rollout(rng: np.random.Generator, reward: float, length: int) -> dict[str, Any]:
    def logprobs() -> list[float]:
        return (-rng.exponential(1.0, size=length)).round(4).tolist()

    return {
        "tokens": rng.integers(0, 300, size=length).tolist(),
        "reward": reward,
        "logprobs": logprobs(),
        "teacher_logprobs": {"pos": logprobs(), "neg": logprobs()},
    }


def request(estimator: Any, seed: int, groups: int = 6, size: int = 4, length: int = 24) -> dict:
    """Groups with mixed rewards, plus an all-correct and an all-wrong (zero-signal) group."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        if g == 0:
            rewards = [1.0] * size
        elif g == 1:
            rewards = [0.0] * size
        else:
            rewards = [float(r) for r in rng.integers(0, 2, size=size)]
            rewards[0], rewards[1] = 1.0, 0.0
        rollouts = [rollout(rng, r, int(rng.integers(4, length))) for r in rewards]
        out.append({"id": f"prompt-{seed}-{g}", "rollouts": rollouts})
    return {"estimator": estimator, "groups": out}


ESTIMATORS: list[Any] = [
    "grpo",
    "ktae",
    "cscr",
    "opsd",
    "rloo",
    {"outcome": "rloo", "ktae": {}, "cscr": {}},
    {"outcome": "grpo", "ktae": {"history": "prompt"}},
]


def send_wave(client: httpx.Client, seed: int, sent: dict[str, int]) -> None:
    """One round of every kind of traffic the dashboards show."""

    def count(response: httpx.Response) -> None:
        summary = response.json()["summary"]
        for key in ("groups", "zero_signal_groups", "tokens"):
            sent[key] += summary[key]
        sent["computed"] += 1

    for i, estimator in enumerate(ESTIMATORS):
        response = client.post("/v1/advantages", json=request(estimator, seed * 100 + i))
        assert response.status_code == 200, response.text
        count(response)
    for body in (b'{"groups": [', b'{"estimator": "no-such-estimator", "groups": []}'):
        response = client.post(
            "/v1/advantages", content=body, headers={"content-type": "application/json"}
        )
        assert response.status_code == 422, response.text
        sent["invalid"] += 1
    # Bursts past ADV_MAX_QUEUE=3: some wait, the rest are refused 503 overloaded, until a
    # quarter of the wave's requests were refused (the overload alert's 5% threshold is then
    # passed however many bursts a slow machine needed before one overlapped).
    requests, refused_in_wave = len(ESTIMATORS) + 2, 0
    big = request("ktae", seed, groups=16, size=8, length=600)
    for _ in range(40):
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: client.post("/v1/advantages", json=big), range(8)))
        assert {r.status_code for r in codes} <= {200, 503}, [r.text for r in codes]
        refused = [r for r in codes if r.status_code == 503]
        for response in codes:
            if response.status_code == 200:
                count(response)
        for response in refused:
            error = response.json()["error"]
            assert error["code"] == "overloaded" and error["retry_after_ms"] > 0, error
            assert int(response.headers["retry-after"]) >= 1
        sent["overloaded"] += len(refused)
        requests += len(codes)
        refused_in_wave += len(refused)
        if refused_in_wave >= requests / 4:
            return
    raise AssertionError(
        f"{refused_in_wave} of {requests} requests refused 503 overloaded at ADV_MAX_QUEUE=3"
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    for binary in ("prometheus", "redis-server"):
        if shutil.which(binary) is None:
            pytest.skip(f"{binary} is not installed (OS package {binary}: `make test-deps`)")
    directory = tmp_path_factory.mktemp("observability")
    processes: list[subprocess.Popen[bytes]] = []
    try:
        # A throwaway redis-server for the stats store (the store panels time Redis calls).
        redis = RedisServer(directory)
        redis.start()
        assert redis.process is not None
        processes.append(redis.process)
        service, service_url = start_service(directory, redis.url)
        processes.append(service)
        prometheus, prometheus_url = start_prometheus(
            directory, service_url.removeprefix("http://")
        )
        processes.append(prometheus)
        stack = Stack(
            service_url,
            prometheus_url,
            dict.fromkeys(
                ("groups", "zero_signal_groups", "tokens", "invalid", "overloaded", "computed"), 0
            ),
        )

        def scraped(expr: str, at_least: float) -> Callable[[], bool]:
            def check() -> bool:
                result = stack.query(expr)["data"]["result"]
                return bool(result) and float(result[0]["value"][1]) >= at_least

            return check

        up = f'up{{job="{JOB}"}}'
        wait_for(scraped(up, 1), 30, "the first scrape of the service")
        total_groups = f'sum(advantage_groups_total{{job="{JOB}"}})'
        refused = f'sum(advantage_request_errors_total{{job="{JOB}", error="overloaded"}})'

        def wave_scraped(wave: int) -> None:
            for expr, key in ((total_groups, "groups"), (refused, "overloaded")):
                wait_for(scraped(expr, stack.sent[key]), 30, f"the scrape of wave {wave}")

        # Two waves, each scraped before the next (a slow machine may miss scrapes): counters
        # created by the first wave increase in the second, so every rate() over them is
        # positive.
        with httpx.Client(base_url=service_url, timeout=60) as client:
            send_wave(client, 1, stack.sent)
            wave_scraped(1)
            send_wave(client, 2, stack.sent)
        wave_scraped(2)
        time.sleep(1.5)  # one more scrape: the queue depth is back to 0 in the newest sample
        yield stack
    finally:
        for process in reversed(processes):
            stop(process)


# ---- the dashboards -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stem", "title", "ref", "expr"),
    panel_queries(),
    ids=[panel_query_id(q) for q in panel_queries()],
)
def test_every_dashboard_panel_query_returns_data(
    stack: Stack, stem: str, title: str, ref: str, expr: str
) -> None:
    query = substitute(expr)
    answer = stack.query(query)
    assert answer["status"] == "success", f"{stem} / {title}: {answer}"
    result = answer["data"]["result"]
    assert result, f"{stem} / {title} / {ref} returned no data: {query}"
    values = [float(sample["value"][1]) for sample in result]
    assert any(math.isfinite(v) for v in values), f"{stem} / {title}: only {values}"


def test_every_dashboard_variable_lists_the_scraped_deployment(stack: Stack) -> None:
    expected = {"namespace": NAMESPACE, "job": JOB}
    for stem, dashboard in dashboards().items():
        for variable in dashboard["templating"]["list"]:
            if variable["type"] != "query":
                continue
            definition = substitute(variable["definition"])
            assert definition.startswith("label_values(") and definition.endswith(")")
            series, _, label = definition[len("label_values(") : -1].rpartition(",")
            response = httpx.get(
                f"{stack.prometheus}/api/v1/label/{label.strip()}/values",
                params={"match[]": series.strip()},
                timeout=30,
            ).json()
            assert response["status"] == "success", response
            assert expected[variable["name"]] in response["data"], (stem, variable["name"])


def test_panels_measure_what_was_sent(stack: Stack) -> None:
    """The numbers behind the dashboards are the traffic's: zero-signal groups (two of every
    request's groups), tokens, rejected requests, overload refusals, and every computed request
    counted once in the queue wait and in one computation."""
    selector = f'job="{JOB}"'
    sent = stack.sent
    zero = stack.scalar(f'sum(advantage_groups_total{{{selector}, signal="zero"}})')
    assert zero == sent["zero_signal_groups"] > 0
    groups = stack.scalar(f"sum(advantage_groups_total{{{selector}}})")
    assert groups == sent["groups"]
    accuracy_count = stack.scalar(f"sum(advantage_group_accuracy_count{{{selector}}})")
    assert accuracy_count == sent["groups"]
    tokens = stack.scalar(f"sum(advantage_tokens_total{{{selector}}})")
    assert tokens == sent["tokens"] > 0
    invalid = stack.scalar(f'sum(advantage_requests_total{{{selector}, code="422"}})')
    assert invalid == sent["invalid"]
    refused = stack.scalar(f'sum(advantage_requests_total{{{selector}, code="503"}})')
    assert refused == sent["overloaded"] > 0
    overloaded = f'sum(advantage_request_errors_total{{{selector}, error="overloaded"}})'
    assert stack.scalar(overloaded) == sent["overloaded"]
    # Every computed request waited once and was computed in one computation.
    waits = stack.scalar(f"sum(advantage_queue_wait_seconds_count{{{selector}}})")
    assert waits == sent["computed"]
    assert stack.scalar(f"sum(advantage_batch_requests_sum{{{selector}}})") == sent["computed"]
    computations = stack.scalar(f"sum(advantage_batch_requests_count{{{selector}}})")
    assert 0 < computations <= sent["computed"]
    assert stack.scalar(f"sum(advantage_queue_depth{{{selector}}})") == 0
    assert stack.scalar(f"sum(advantage_max_queue{{{selector}}})") == 3


# ---- the alerts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_every_alert_expression_evaluates_and_reads_exported_metrics(
    stack: Stack, rule: dict[str, Any]
) -> None:
    answer = stack.query(rule["expr"])
    assert answer["status"] == "success", f"{rule['alert']}: {answer}"
    exposition = httpx.get(stack.service + "/metrics", timeout=30).text
    assert not unknown_metrics(rule["expr"], exposition), rule["alert"]


def test_prometheus_loads_and_evaluates_the_alert_rules(stack: Stack) -> None:
    def evaluated() -> list[dict[str, Any]] | None:
        groups = httpx.get(f"{stack.prometheus}/api/v1/rules", timeout=30).json()["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        # A rule not evaluated yet reports the zero time.
        if rules and all(not r.get("lastEvaluation", "0001").startswith("0001") for r in rules):
            return rules
        return None

    rules = wait_for(evaluated, 30, "a first evaluation of every rule")
    assert {r["name"] for r in rules} == {r["alert"] for r in alert_rules()}
    for rule in rules:
        assert rule["health"] == "ok", rule
    # The healthy service under test trips none of them. The deliberate burst past the queue
    # has started the overload alert's `for` clock (and may have the queue alert's), but its
    # 503s are not server errors: the error-ratio alert stays quiet.
    states = {r["name"]: r["state"] for r in rules}
    active = {name for name, state in states.items() if state != "inactive"}
    assert states["AdvantageServiceOverloaded"] == "pending", (states, stack.sent)
    assert states["AdvantageServiceErrorRatioHigh"] == "inactive", states
    assert active <= {"AdvantageServiceOverloaded", "AdvantageServiceQueueNearCapacity"}, active
    assert not [name for name, state in states.items() if state == "firing"]
