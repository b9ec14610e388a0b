"""One client of bench_fleet.py, as its own process with nothing but httpx imported (64 of them
start on a small machine without stealing the measured window):

    python bench/fleet_client.py URL BODY_FILE START_AT STOP_AT OUT_FILE

Sends the body back to back from START_AT until STOP_AT (Unix times), no retries, and writes
``{"ready_at", "latencies", "refused", "failed"}`` as JSON to OUT_FILE.
"""

from __future__ import annotations

import json
import sys
import time

import httpx


def main() -> None:
    url, body_file, start_at, stop_at, out_file = sys.argv[1:6]
    body = open(body_file, "rb").read()  # noqa: SIM115
    latencies: list[float] = []
    refused = failed = 0
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=url, timeout=120.0) as http:
        http.get("/healthz")  # connected before the start
        ready_at = time.time()
        time.sleep(max(0.0, float(start_at) - time.time()))
        while time.time() < float(stop_at):
            started = time.perf_counter()
            try:
                status = http.post("/v1/advantages", content=body, headers=headers).status_code
            except httpx.HTTPError:
                failed += 1
                continue
            if status == 200:
                latencies.append(time.perf_counter() - started)
            elif status in (429, 503):
                refused += 1
            else:
                failed += 1
    with open(out_file, "w") as out:
        json.dump(
            {"ready_at": ready_at, "latencies": latencies, "refused": refused, "failed": failed},
            out,
        )


if __name__ == "__main__":
    main()
