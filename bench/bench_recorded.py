"""Are the statistics of answered requests counted? Small KTAE requests with history, N clients.

    python bench/bench_recorded.py [--clients 1,2,4,8,32] [--seconds 3] [--stores memory,redis]

For each store (the embedded one; a redis-server of its own on a free port) one service process
(``advantage-service serve``, CPU, default settings) and, for each N, N concurrent HTTP clients
that send small KTAE-with-history requests (``{"outcome": "grpo", "ktae": {"history":
"prompt"}}``; 2 groups x 4 rollouts x 32 tokens, ids below 2,000, prompt ids drawn from 64 per
run) for ``--seconds`` each, every request in a namespace of the run's own. Then it waits for the
writes to settle (the namespace's ``rollouts_counted`` unchanged for a second) and prints, per
run: requests answered 200, those whose ``summary.recorded`` was true / false, the requests the
statistics count (``GET /v1/stats/tokens``: rollouts counted / rollouts per request), counted /
answered, and the 503s (pushback: the client retries after the hint). The goal: counted =
answered while the store is up, and every answer not counted said ``recorded: false``.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests"))

from service_process import ServiceProcess  # noqa: E402
from stats.redis_support import RedisServer  # noqa: E402

ESTIMATOR = {"outcome": "grpo", "ktae": {"history": "prompt"}}
GROUPS, ROLLOUTS, TOKENS, VOCAB, PROMPTS = 2, 4, 32, 2000, 64


def make_request(rng: random.Random, namespace: str) -> dict[str, Any]:
    groups = [
        {
            "id": f"p{prompt}",  # the group id is the prompt id: its history's key
            "rollouts": [
                {"tokens": [rng.randrange(VOCAB) for _ in range(TOKENS)], "reward": float(r % 2)}
                for r in range(ROLLOUTS)
            ],
        }
        for prompt in rng.sample(range(PROMPTS), GROUPS)
    ]
    return {"namespace": namespace, "estimator": ESTIMATOR, "groups": groups}


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.answered = 0
        self.recorded: dict[Any, int] = {}
        self.overloaded = 0
        self.failed = 0
        self.seconds: list[float] = []

    def add(self, response: httpx.Response, seconds: float) -> float:
        """Counts the answer; the seconds to wait before the next request (503's hint)."""
        with self.lock:
            if response.status_code == 200:
                self.answered += 1
                self.seconds.append(seconds)
                value = response.json()["summary"].get("recorded", "absent")
                self.recorded[value] = self.recorded.get(value, 0) + 1
                return 0.0
            if response.status_code == 503:
                self.overloaded += 1
                hint = response.json()["error"].get("retry_after_ms") or 50
                return float(hint) / 1000.0
            self.failed += 1
            return 0.0


def client(
    http: httpx.Client,
    namespace: str,
    seed: int,
    start: threading.Barrier,
    run: list[float],
    tally: Tally,
) -> None:
    rng = random.Random(seed)
    start.wait()
    while time.monotonic() < run[0]:
        body = make_request(rng, namespace)
        began = time.perf_counter()
        try:
            response = http.post("/v1/advantages", json=body)
            wait = tally.add(response, time.perf_counter() - began)
        except httpx.TransportError:
            with tally.lock:
                tally.failed += 1
            continue
        if wait:
            time.sleep(wait)


def counted_rollouts(url: str, namespace: str) -> int:
    body = httpx.get(url + "/v1/stats/tokens", params={"namespace": namespace, "limit": 1}).json()
    return int(body["rollouts_counted"])


def settle(url: str, namespace: str, expected: int, timeout: float = 60.0) -> int:
    """The namespace's rollouts counted once unchanged for a second (or at ``expected``)."""
    deadline = time.monotonic() + timeout
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now = counted_rollouts(url, namespace)
        if now >= expected:
            return now
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since > 1.0:
            return now
        time.sleep(0.1)
    return last


def metric_values(url: str) -> dict[str, float]:
    """The writer's counters: requests per outcome, and the rounds' sum and count."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("advantage_stats_requests_total{"):
            out[line.split('"')[1]] = float(line.split()[-1])
        elif line.startswith("advantage_stats_write_round_requests_sum"):
            out["round_sum"] = float(line.split()[-1])
        elif line.startswith("advantage_stats_write_round_requests_count"):
            out["round_count"] = float(line.split()[-1])
    return out


def run(url: str, store: str, clients: int, seconds: float) -> dict[str, Any]:
    namespace = f"bench-{store}-{clients}-{int(time.time() * 1000)}"
    tally = Tally()
    # Clients and their connections are made before the clock starts (an httpx client's TLS
    # context alone costs tens of ms of CPU: 32 of them would eat the run on a small machine).
    https = [httpx.Client(base_url=url, timeout=60) for _ in range(clients)]
    for http in https:
        http.get("/healthz")
    start = threading.Barrier(clients + 1)
    stop = [0.0]
    threads = [
        threading.Thread(
            target=client, args=(https[i], namespace, 1000 * clients + i, start, stop, tally)
        )
        for i in range(clients)
    ]
    for thread in threads:
        thread.start()
    stop[0] = time.monotonic() + seconds
    start.wait()
    for thread in threads:
        thread.join()
    for http in https:
        http.close()
    per_request = GROUPS * ROLLOUTS
    counted = settle(url, namespace, tally.answered * per_request) / per_request
    return {
        "store": store,
        "clients": clients,
        "answered": tally.answered,
        "recorded": tally.recorded,
        "counted": counted,
        "overloaded": tally.overloaded,
        "failed": tally.failed,
        "p50_ms": 1000 * percentile(tally.seconds, 0.5),
        "p99_ms": 1000 * percentile(tally.seconds, 0.99),
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", default="1,2,4,8,32")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--stores", default="memory,redis")
    args = parser.parse_args()
    counts = [int(n) for n in args.clients.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        for store in args.stores.split(","):
            redis = RedisServer(directory / "redis") if store == "redis" else None
            settings: dict[str, Any] = {}
            if redis is not None:
                redis.start()
                settings["redis_url"] = redis.url
            service = ServiceProcess(settings=settings, log=directory / f"service-{store}.log")
            url = service.url
            try:
                before = metric_values(url)
                for n in counts:
                    row = run(url, store, n, args.seconds)
                    after = metric_values(url)
                    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                    rounds = delta.get("round_count", 0.0)
                    row["per_round"] = delta.get("round_sum", 0.0) / rounds if rounds else 0.0
                    row["lost"] = delta.get("lost", 0.0)
                    before = after
                    rows.append(row)
                    print(row, flush=True)
            finally:
                service.stop(60)
                if redis is not None:
                    redis.stop()
    print()
    print(
        "| store | clients | answered | recorded true / false | counted | counted / answered "
        "| lost | requests per write round | p50 / p99 ms | 503 (retried) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        rec = r["recorded"]
        share = r["counted"] / r["answered"] if r["answered"] else float("nan")
        print(
            f"| {r['store']} | {r['clients']} | {r['answered']} | "
            f"{rec.get(True, 0)} / {rec.get(False, 0)} | {r['counted']:.0f} | "
            f"{100 * share:.1f}% | {r['lost']:.0f} | {r['per_round']:.1f} | "
            f"{r['p50_ms']:.0f} / {r['p99_ms']:.0f} | {r['overloaded']} |"
        )


if __name__ == "__main__":
    main()
