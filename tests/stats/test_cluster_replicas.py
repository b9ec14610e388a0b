"""Three service replicas behind a real haproxy (health checks on ``/readyz``, as a Kubernetes
Service with readiness probes), sharing a Redis Cluster: 32 clients for 30 s while one replica
is SIGTERMed and started again. No request fails (503s the client's retry answered are
counted), every request answered ``recorded: true`` is counted exactly once, and history
written through one replica is read through the others.

(``recorded: false`` says the replica did not take the statistics: it held the Redis Cluster
for unreachable at that moment. On a machine short of CPU a replica's Redis timeout can still
run out, so those few are not counted and not expected; the test holds them under 2% of the
answers, and counts exactly the others.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from cluster_load import (
    NAMESPACE,
    REQUEST_ROLLOUTS,
    Load,
    prompts,
    request,
    send,
    stats_outcomes,
)
from process_support import ServiceProcess, free_port, poll, service_env
from redis_cluster_support import LocalCluster

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
CLIENTS = 32
SECONDS = 30.0

HAPROXY_CONFIG = """
global
    maxconn 4096
defaults
    mode http
    timeout connect 1s
    timeout client 60s
    timeout server 60s
    # A connection refused by a replica that is going away: try another (the request never
    # reached it, so this is safe for a POST).
    retries 3
    option redispatch
    retry-on conn-failure empty-response
frontend advantage
    bind 127.0.0.1:{port}
    default_backend replicas
backend replicas
    balance roundrobin
    option httpchk GET /readyz
    http-check expect status 200
    default-server inter 250ms fall 1 rise 2
{servers}
"""


class Replica:
    """A service process on fixed ports (so that it can be started again behind haproxy)."""

    def __init__(self, directory: Path, redis_url: str) -> None:
        self.directory = directory
        self.settings = {"redis_url": redis_url, "shutdown_delay_seconds": 1}
        self.http_port, self.grpc_port = free_port(), free_port()
        self.process: ServiceProcess | None = None

    def start(self) -> None:
        log = self.directory / f"replica-{self.http_port}-{time.monotonic_ns()}.log"
        ports = ["--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port)]
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "advantage_service", "serve", *ports],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=service_env(self.settings),
            )
        url = f"http://127.0.0.1:{self.http_port}"
        self.process = ServiceProcess(proc, url, log, httpx.Client(base_url=url, timeout=30.0))
        self.process.ready_or_killed()

    def stop(self) -> int:
        assert self.process is not None
        code = self.process.stop(60)
        self.process = None
        return code


def start_haproxy(directory: Path, replicas: list[Replica]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    servers = "\n".join(
        f"    server r{i} 127.0.0.1:{r.http_port} check" for i, r in enumerate(replicas)
    )
    config = directory / "haproxy.cfg"
    config.write_text(HAPROXY_CONFIG.format(port=port, servers=servers))
    log = (directory / "haproxy.log").open("wb")
    proc = subprocess.Popen([HAPROXY, "-db", "-f", str(config)], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        try:
            return httpx.get(f"{url}/readyz", timeout=1.0).status_code == 200
        except httpx.TransportError:
            return False

    poll(answers, 20, "haproxy to answer")
    return proc, url


@pytest.fixture
def haproxy() -> str:
    if not Path(HAPROXY).exists():
        pytest.skip("haproxy is not installed (OS package haproxy: make test-deps)")
    return HAPROXY


def counted(url: str) -> int:
    response = httpx.get(f"{url}/v1/stats/tokens", params={"namespace": NAMESPACE}, timeout=30)
    assert response.status_code == 200, response.text
    return int(response.json()["rollouts_counted"])


def test_replicas_behind_haproxy_lose_and_double_count_nothing_while_one_restarts(
    haproxy: str, redis_cluster: LocalCluster, tmp_path: Path
) -> None:
    pool = prompts()
    replicas = [Replica(tmp_path, redis_cluster.url) for _ in range(3)]
    proxy = None
    try:
        for replica in replicas:
            replica.start()
        proxy, url = start_haproxy(tmp_path, replicas)
        load = Load(url, CLIENTS, pool, "lb").start()
        time.sleep(SECONDS / 3)
        restarted = replicas[1]
        assert restarted.stop() == 0, "the replica did not drain cleanly"
        time.sleep(2)
        restarted.start()
        time.sleep(SECONDS / 3 * 2 - 2)
        load.stop()

        answers = load.answers
        retried = sum(a.retried_503 for a in answers)
        assert all(a.status == 200 for a in answers), [a for a in answers if a.status != 200]
        print(
            f"haproxy: {len(answers)} requests from {CLIENTS} clients in {SECONDS:.0f} s, "
            f"all answered; {retried} 503s or refused connections answered by a retry"
        )
        # Every request answered recorded: true counted once: the statistics of each replica's
        # writes, the drained one's included, and no retry counted twice.
        ids = {a.request_id for a in answers}
        assert len(ids) == len(answers)
        unrecorded = sum(a.recorded is not True for a in answers)
        assert unrecorded < 0.02 * len(answers), f"{unrecorded} answered recorded: false"
        want = REQUEST_ROLLOUTS * (len(ids) - unrecorded)
        last: list[int] = []

        def all_counted() -> bool:
            last[:] = [counted(url)]
            return last[0] == want

        try:
            poll(all_counted, 60, "every request counted")
        except AssertionError:
            # (what each replica running now says became of its requests' statistics)
            said = [stats_outcomes(r.process) for r in replicas if r.process is not None]
            raise AssertionError(
                f"{last[0]} rollouts counted, {want} expected ({len(ids)} requests, "
                f"{unrecorded} of them answered recorded: false); the replicas' statistics "
                f"outcomes {said}; logs in {tmp_path}"
            ) from None
        time.sleep(1)
        assert counted(url) == want
        # History written through any replica is read through each.
        assert sum(a.history == "applied" for a in answers) > 0.9 * len(answers)
        for replica in replicas:
            assert replica.process is not None
            answer = send(replica.process.http, request(f"direct-{replica.http_port}", 1, pool))
            assert answer.status == 200 and answer.history == "applied"
            assert all(h == "applied" for _, h in answer.groups)
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        for replica in replicas:
            if replica.process is not None:
                replica.stop()
