"""One Redis against a 3-master Redis Cluster (every node on this machine).

    python bench/bench_cluster.py [--prompts 10000] [--clients 32] [--seconds 10] [--rounds 2]

1. Spread: a run of ``--prompts`` prompts written through the cluster (KTAE with history,
   32 prompts per request, 4 rollouts x 48 tokens, through the service's engine and writer):
   keys and bytes per master (``DBSIZE``, the history records' ``STRLEN``, ``used_memory``
   over the empty node's), against their mean (the goal: every master within +-20%).
2. Round trips of one 32-prompt request with history and a request id, from the service's side
   (one read, one write) and per node (the cluster client's pipelines, one per node touched).
3. Load: one service process (``advantage-service serve``, CPU, default settings) on each store
   in turn (``--rounds`` times, alternating), ``--clients`` HTTP clients sending such requests
   for ``--seconds`` (prompts drawn from 2,000 visited before, so every read finds history):
   answers per second, p50/p99 latency, the node round trips per request (the service's
   ``advantage_stats_store_round_trips_total``: pipelines sent to nodes; the writer coalesces
   the writes of requests answered together, so under load a write costs less than one per
   request) and the commands per request and master (``INFO commandstats``, the calls inside
   the write scripts included).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import redis
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "stats"))

from redis_cluster_support import LocalCluster  # noqa: E402
from redis_support import RedisServer  # noqa: E402
from service_process import ServiceProcess  # noqa: E402

ESTIMATOR = {"outcome": "grpo", "ktae": {"history": "prompt"}}
GROUPS, ROLLOUTS, TOKENS, VOCAB = 32, 4, 48, 2000
NAMESPACE = "bench-cluster"


def make_request(rng: random.Random, prompts: list[str], request_id: str) -> dict[str, Any]:
    groups = [
        {
            "id": prompt,
            "rollouts": [
                {"tokens": [rng.randrange(VOCAB) for _ in range(TOKENS)], "reward": float(r % 2)}
                for r in range(ROLLOUTS)
            ],
        }
        for prompt in prompts
    ]
    return {
        "request_id": request_id,
        "namespace": NAMESPACE,
        "estimator": ESTIMATOR,
        "groups": groups,
    }


def node_info(port: int) -> dict[str, Any]:
    with redis.Redis(port=port) as client:
        info = client.info("all")
    commands = sum(v["calls"] for k, v in info.items() if k.startswith("cmdstat_"))
    return {
        "keys": int(client_dbsize(port)),
        "used_memory": int(info["used_memory"]),
        "commands": int(commands),
        "reads": int(info["total_reads_processed"]),
    }


def client_dbsize(port: int) -> int:
    with redis.Redis(port=port) as client:
        return int(client.dbsize())


def record_bytes(port: int) -> int:
    total = 0
    with redis.Redis(port=port) as client:
        for key in client.scan_iter(match="adv:*:history:*", count=1000):
            total += int(client.strlen(key))
    return total


async def spread(cluster: LocalCluster, prompts: int) -> None:
    from advantage_service.config import Settings
    from advantage_service.observability.metrics import Metrics
    from advantage_service.serving.engine import Engine
    from advantage_service.wire.request import parse_request

    masters = list(cluster.masters())
    empty = {port: node_info(port)["used_memory"] for port in masters}
    engine = Engine(Settings(device="cpu", redis_url=cluster.url), Metrics(process=False))
    await engine.start()
    rng = random.Random(1)
    names = [f"prompt-{i}" for i in range(prompts)]
    start = time.perf_counter()
    try:
        batches = [names[i : i + GROUPS] for i in range(0, prompts, GROUPS)]
        for i in range(0, len(batches), 8):  # eight at a time: the writer coalesces them
            await asyncio.gather(
                *(
                    engine.compute(parse_request(make_request(rng, b, f"spread-{i}-{j}")), "bench")
                    for j, b in enumerate(batches[i : i + 8])
                )
            )
        await engine.settle_writes()
    finally:
        await engine.flush()
        engine.close()
    seconds = time.perf_counter() - start
    rows = []
    for port in masters:
        info = node_info(port)
        rows.append((info["keys"], record_bytes(port), info["used_memory"] - empty[port]))
    means = [statistics.mean(r[i] for r in rows) for i in range(3)]
    print(f"\n1. {prompts} prompts written through the cluster in {seconds:.1f} s")
    print("| master | keys | history record bytes | used_memory growth |")
    print("|---|---|---|---|")
    for port, row in zip(masters, rows, strict=True):
        cells = [f"{v:,} ({100 * (v / m - 1):+.1f}%)" for v, m in zip(row, means, strict=True)]
        print(f"| :{port} | " + " | ".join(cells) + " |")


async def lone_request(cluster: LocalCluster) -> None:
    from advantage_service.stats import RedisStatsStore
    from stats_helpers import serve  # type: ignore[import-not-found]

    store = RedisStatsStore(cluster.url)
    await store.ping()
    assert store.cluster is not None
    rng = random.Random(2)
    prompts = [f"prompt-{i}" for i in range(GROUPS)]
    body = make_request(rng, prompts, "lone")
    before = store.round_trips
    served = await serve(store, body)
    trips = store.round_trips - before
    await store.close()
    masters = {
        cluster.master_of(store.cluster.record_slot(NAMESPACE, ("history", p))) for p in prompts
    }
    print(
        f"\n2. one {GROUPS}-prompt request with history (counted: {served.counted}): "
        f"{trips} node round trips = read {len(masters)} (one pipeline per master its prompts "
        f"live on) + write {trips - len(masters)} (the records, one pipeline per master, then "
        "the statistics on one bucket's master); one Redis: 1 + 1"
    )


def load(url: str, clients: int, seconds: float, pool: list[str], tag: str) -> list[float]:
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def client(index: int) -> None:
        rng = random.Random(hash((tag, index)))
        with httpx.Client(base_url=url, timeout=120.0) as http:
            n = 0
            while time.monotonic() < stop:
                body = make_request(rng, rng.sample(pool, GROUPS), f"{tag}-{index}-{n}")
                n += 1
                start = time.perf_counter()
                response = http.post("/v1/advantages", json=body)
                elapsed = time.perf_counter() - start
                if response.status_code == 200:
                    with lock:
                        latencies.append(elapsed)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies


def round_trips(url: str) -> float:
    """The service's advantage_stats_store_round_trips_total."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "advantage_stats_store_round_trips_total":
                return float(sample.value)
    raise RuntimeError("no advantage_stats_store_round_trips_total")


def warm(url: str, pool: list[str]) -> None:
    rng = random.Random(3)
    with httpx.Client(base_url=url, timeout=120.0) as http:
        for i in range(0, len(pool), GROUPS):
            http.post("/v1/advantages", json=make_request(rng, pool[i : i + GROUPS], f"warm-{i}"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        cluster = LocalCluster(directory / "cluster", masters=3)
        single = RedisServer(directory / "single")
        cluster.start()
        single.start()
        try:
            asyncio.run(spread(cluster, args.prompts))
            cluster.flush()
            asyncio.run(lone_request(cluster))
            cluster.flush()
            pool = [f"hot-{i}" for i in range(2000)]
            results: dict[str, list[list[float]]] = {"one Redis": [], "3-master cluster": []}
            costs: dict[str, list[tuple[float, float]]] = {k: [] for k in results}
            services = {}
            for name, url, ports in (
                ("one Redis", single.url, [single.port]),
                ("3-master cluster", cluster.url, list(cluster.masters())),
            ):
                service = ServiceProcess(
                    settings={"redis_url": url}, log=directory / f"service-{len(services)}.log"
                )
                services[name] = (service, service.url, ports)
                warm(service.url, pool)
            for round_ in range(args.rounds):
                for name, (_, service_url, ports) in services.items():
                    before = {p: node_info(p) for p in ports}
                    trips = round_trips(service_url)
                    got = load(service_url, args.clients, args.seconds, pool, f"{name}-{round_}")
                    time.sleep(2)  # (the writes after the last answers)
                    trips = round_trips(service_url) - trips
                    after = {p: node_info(p) for p in ports}
                    results[name].append(got)
                    commands = [after[p]["commands"] - before[p]["commands"] for p in ports]
                    costs[name].append((trips / len(got), statistics.mean(commands) / len(got)))
            for service, _, _ in services.values():
                service.stop(60)
            print(
                f"\n3. {args.clients} clients, {GROUPS}-prompt KTAE requests with history, "
                f"{args.rounds} x {args.seconds:.0f} s per store, alternating"
            )
            print(
                "| store | answers/s | p50 | p99 | node round trips per request | commands "
                "per request and master (script calls included) |"
            )
            print("|---|---|---|---|---|---|")
            for name, runs in results.items():
                lat = np.array([x for run in runs for x in run])
                rate = len(lat) / (args.rounds * args.seconds)
                trips = statistics.mean(t for t, _ in costs[name])
                commands = statistics.mean(c for _, c in costs[name])
                print(
                    f"| {name} | {rate:.1f} | {1000 * np.percentile(lat, 50):.0f} ms | "
                    f"{1000 * np.percentile(lat, 99):.0f} ms | {trips:.2f} | {commands:.0f} |"
                )
        finally:
            cluster.stop()
            single.stop()


if __name__ == "__main__":
    main()
