"""A master of a 3-master, 3-replica Redis Cluster killed under load, behind a real service
process: requests keep being answered (the groups on the failed master's slots without their
history while the failover runs, ``summary.history: "partial"``), ``/readyz`` says ``degraded``
then ``up``, the service follows the promoted replica without a restart, and nothing counted
while the cluster was healthy is lost (claims included: resent requests are not counted
again)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cluster_load import NAMESPACE, REQUEST_ROLLOUTS, Load, prompts, send, stats_outcomes
from process_support import ServiceProcess, launch_service, poll
from redis.crc import key_slot
from redis_cluster_support import REDIS_CLI, LocalCluster
from redis_support import REDIS_SERVER

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLIENTS = 6


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    if not (os.path.exists(REDIS_SERVER) and os.path.exists(REDIS_CLI)):
        pytest.skip("redis-server or redis-cli is not installed (OS package redis-server)")
    cluster = LocalCluster(tmp_path / "cluster", masters=3, replicas=1)
    cluster.start()
    yield cluster
    cluster.stop()


def service(directory: Path, url: str) -> ServiceProcess:
    proc, port, _, log = launch_service(directory, {"redis_url": url})
    base = f"http://127.0.0.1:{port}"
    process = ServiceProcess(proc, base, log, httpx.Client(base_url=base, timeout=30.0))
    process.ready_or_killed()
    return process


def settled(process: ServiceProcess, answered: int) -> dict[str, float]:
    """Wait until the statistics of ``answered`` requests are written (or given up)."""

    def done() -> dict[str, float] | None:
        got = stats_outcomes(process)
        return got if sum(got.values()) >= answered else None

    result: dict[str, float] = poll(done, 60, f"the statistics of {answered} requests")
    return result


def rollouts_counted(process: ServiceProcess) -> int:
    response = process.http.get("/v1/stats/tokens", params={"namespace": NAMESPACE})
    assert response.status_code == 200, response.text
    return int(response.json()["rollouts_counted"])


def replicated(cluster: LocalCluster) -> bool:
    """Every master's writes reached its replica."""
    for port in cluster.masters():
        with cluster.client(port) as client:
            info = client.info("replication")
        offset = info["master_repl_offset"]
        replicas = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
        if not replicas or any(r["offset"] != offset for r in replicas):
            return False
    return True


def test_a_killed_master_under_load_fails_over_and_loses_nothing_counted_before(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    pool = prompts()
    process = service(tmp_path, cluster.url)
    try:
        # Healthy: everything answered, applied and counted, and replicated.
        healthy = Load(process.url, CLIENTS, pool, "healthy").start()
        time.sleep(3)
        healthy.stop()
        assert healthy.ok() and len(healthy.ok()) == len(healthy.answers)
        before = settled(process, len(healthy.answers))
        assert before == {"counted": len(healthy.answers)}
        counted_healthy = rollouts_counted(process)
        assert counted_healthy == REQUEST_ROLLOUTS * len(healthy.answers)
        poll(lambda: replicated(cluster), 10, "the replicas to catch up")

        # A master killed under load.
        victim = next(iter(cluster.masters()))
        victim_slots = cluster.masters()[victim]
        statuses: list[tuple[str, float]] = []
        watching = threading.Event()

        def watch() -> None:
            with httpx.Client(base_url=process.url, timeout=5.0) as client:
                while not watching.is_set():
                    store = client.get("/readyz").json()["stats_store"]
                    degraded = process.gauge("advantage_stats_store_degraded")
                    statuses.append((store, degraded))
                    time.sleep(0.1)

        watcher = threading.Thread(target=watch, daemon=True)
        failing = Load(process.url, CLIENTS, pool, "failover").start()
        watcher.start()
        time.sleep(1)
        cluster.kill(victim)
        killed_at = time.monotonic()
        cluster.wait_ok(30)
        poll(lambda: process.http.get("/readyz").json()["stats_store"] == "up", 30, "up again")
        recovered_at = time.monotonic()
        time.sleep(1)
        failing.stop()
        watching.set()
        watcher.join(10)

        # Every request answered; while the failover ran, only groups on the victim's slots
        # went without history.
        assert failing.ok() and len(failing.ok()) == len(failing.answers)
        partial = [a for a in failing.ok() if a.history == "partial"]
        assert partial, "no request saw the failover"
        for answer in partial:
            for prompt, group_history in answer.groups:
                slot = key_slot(f"{NAMESPACE}:history:{prompt}".encode())
                on_victim = any(a <= slot <= b for a, b in victim_slots)
                assert (group_history == "unavailable") == on_victim, (prompt, answer)
        assert ("degraded", 1.0) in statuses and statuses[-1] == ("up", 0.0), statuses
        print(
            f"failover: {len(failing.answers)} answered, {len(partial)} partial, "
            f"{recovered_at - killed_at:.1f} s from the kill to up"
        )
        settled(process, len(healthy.answers) + len(failing.answers))

        # What was counted while healthy survived, claims too: resent, none counts again.
        after_failover = rollouts_counted(process)
        assert after_failover >= counted_healthy
        resent = healthy.sent[:: max(1, len(healthy.sent) // 20)]
        with httpx.Client(base_url=process.url, timeout=30.0) as client:
            again = [send(client, body) for body in resent]
        assert all(a.status == 200 and a.history == "applied" for a in again)
        assert all(h == "applied" for a in again for _, h in a.groups), "history lost"
        total = len(healthy.answers) + len(failing.answers) + len(resent)
        final = settled(process, total)
        assert final["duplicate"] == len(resent)
        assert rollouts_counted(process) == after_failover

        # Recovered without a restart: new requests counted in full.
        recovered = Load(process.url, 2, pool, "after").start()
        time.sleep(1)
        recovered.stop()
        assert all(a.history == "applied" for a in recovered.ok())
        settled(process, total + len(recovered.answers))
        assert rollouts_counted(process) == after_failover + REQUEST_ROLLOUTS * len(
            recovered.answers
        )
        assert process.proc.poll() is None
    finally:
        process.stop()
