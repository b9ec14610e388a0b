"""A trainer fleet against one replica on its defaults: N client processes, each sending small
requests over HTTP (JSON) as fast as it can, with no retries (``fleet_client.py``: a process
each, importing nothing but httpx, all connected before the measured window opens).

    python bench/bench_fleet.py [--duration 20] [--clients 1,4,8,16,32,64]
        [--estimators ktae,grpo] [--merging on,off]

The request: 4 groups x 8 rollouts x 512 tokens (lengths 256-768, Zipf ids), the same body for
every call of a client. For every estimator, merging setting (``off`` is ADV_MAX_BATCH_TOKENS=0)
and N, a fresh service process on its defaults (ADV_MAX_INFLIGHT=4, ADV_MAX_QUEUE=256, ...)
and N processes for ``--duration`` seconds. Prints per run: requests answered and refused,
requests/s and tokens/s answered, p50/p99 latency of the answered, fairness (the fewest and most
answers of one client, and their ratio), and requests per computation (the service's
``advantage_batch_requests`` histogram over the run). Then the ratio of requests/s with merging
on to off at each N, and the markdown table the README records.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loadgen import Shape, make_request
from service_process import ServiceProcess

SHAPE = Shape(groups=4, rollouts=8, tokens=512)
CLIENT = Path(__file__).resolve().parent / "fleet_client.py"


def batch_histogram(url: str) -> tuple[float, float]:
    """(sum, count) of the service's advantage_batch_requests histogram."""
    text = httpx.get(url + "/metrics", timeout=10).text
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("advantage_batch_requests_sum"):
            total = float(line.split()[-1])
        elif line.startswith("advantage_batch_requests_count"):
            count = float(line.split()[-1])
    return total, count


def run(estimator: str, merging: str, clients: int, duration: float) -> dict[str, Any]:
    body = orjson.dumps(
        make_request(0, SHAPE, estimator=estimator, namespace="fleet", prompts=64),
        option=orjson.OPT_SERIALIZE_NUMPY,
    )
    tokens = sum(len(r["tokens"]) for g in json.loads(body)["groups"] for r in g["rollouts"])
    settings = {} if merging == "on" else {"max_batch_tokens": 0}
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        service = ServiceProcess(settings=settings, log=Path(tmp) / "service.log", log_level="info")
        url = service.url
        try:
            # One warm-up request, then every client starts at the same instant.
            httpx.post(url + "/v1/advantages", content=body, timeout=60)
            before = batch_histogram(url)
            body_file = Path(tmp) / "body.json"
            body_file.write_bytes(body)
            # Every client process starts (imports, connects) before the window opens.
            start_at = time.time() + 3.0 + 0.2 * clients
            stop_at = start_at + duration
            outs = [Path(tmp) / f"client-{i}.json" for i in range(clients)]
            procs = [
                subprocess.Popen(
                    [
                        sys.executable,
                        str(CLIENT),
                        url,
                        str(body_file),
                        str(start_at),
                        str(stop_at),
                        str(out),
                    ]
                )
                for out in outs
            ]
            for p in procs:
                p.wait(duration + 300)
            after = batch_histogram(url)
            results = [json.loads(out.read_text()) for out in outs]
            late = sum(r["ready_at"] > start_at for r in results)
        finally:
            service.stop(60)
    answered = [len(r["latencies"]) for r in results]
    latencies = np.array([x for r in results for x in r["latencies"]])
    computations = after[1] - before[1]
    return {
        "estimator": estimator,
        "merging": merging,
        "clients": clients,
        "answered": int(sum(answered)),
        "refused": int(sum(r["refused"] for r in results)),
        "failed": int(sum(r["failed"] for r in results)),
        "late_clients": late,
        "requests_per_s": sum(answered) / duration,
        "tokens_per_s": sum(answered) * tokens / duration,
        "p50_ms": float(np.percentile(latencies, 50) * 1000) if latencies.size else None,
        "p99_ms": float(np.percentile(latencies, 99) * 1000) if latencies.size else None,
        "fewest": min(answered),
        "most": max(answered),
        "fairness": min(answered) / max(answered) if max(answered) else 0.0,
        "requests_per_computation": (after[0] - before[0]) / computations if computations else 0,
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| estimator | merging | clients | answered | refused | req/s | tokens/s | p50 ms "
        "| p99 ms | fewest/most per client | req per computation |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['estimator']} | {r['merging']} | {r['clients']} | {r['answered']:,} | "
            f"{r['refused']:,} | {r['requests_per_s']:.1f} | {r['tokens_per_s']:,.0f} | "
            f"{r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['fewest']}/{r['most']} "
            f"({r['fairness']:.2f}) | {r['requests_per_computation']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--clients", default="1,4,8,16,32,64")
    parser.add_argument("--estimators", default="ktae,grpo")
    parser.add_argument("--merging", default="on,off")
    args = parser.parse_args()
    rows = []
    for estimator in args.estimators.split(","):
        for n in (int(c) for c in args.clients.split(",")):
            for merging in args.merging.split(","):
                row = run(estimator, merging, n, args.duration)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print()
    for estimator in args.estimators.split(","):
        mine = [r for r in rows if r["estimator"] == estimator]
        best = max(r["requests_per_s"] for r in mine if r["merging"] == "on")
        for r in mine:
            if r["merging"] == "on" and r["clients"] == 32:
                print(
                    f"{estimator}: req/s at 32 clients / best of any N: "
                    f"{r['requests_per_s'] / best:.2f}"
                )
        by = {(r["clients"], r["merging"]): r["requests_per_s"] for r in mine}
        for n in sorted({r["clients"] for r in mine}):
            if (n, "on") in by and (n, "off") in by and by[(n, "off")]:
                ratio = by[(n, "on")] / by[(n, "off")]
                print(f"{estimator} {n} clients: merging on / off {ratio:.2f}")
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
