"""Stats-store cost per request on the training-sized batch, for both backends.

    python bench/bench_stats.py [--device cpu|cuda|auto] [--visits 5] [--threads N]

The batch: 32 groups x 16 rollouts x up to 4096 tokens, Zipf ids over 151,936 (synthetic.py),
estimator GRPO + KTAE with per-prompt history + CSCR, the same 32 prompt ids on every visit.
It starts its own redis-server on a free port in a temporary directory (never the shared one).

Prints per backend, medians over the visits after the first (history present):
  - Redis round trips per request, counted on the client's connections (sends: one per command
    or pipeline); must be 2 with history;
  - the response path: history query + read, against the compute time (with history);
  - the write path (scheduled after the response): building the updates + the write;
  - reading the vocabulary statistics back (order=key, limit=100);
  - sizes: (prompt, token) rows read and written, distinct token ids counted.

On a machine with few cores pass --threads 1: torch's intra-op threads then do not fight
redis-server and the event loop for the cores, and the timings are stable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis.asyncio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from advantage_service import compute_batch
from advantage_service.estimators import TermContext, resolve_device, resolve_estimator
from advantage_service.request import ComputeRequest
from advantage_service.stats import (
    MemoryStatsStore,
    RedisStatsStore,
    StatsStore,
    build_updates,
    history_query,
)
from synthetic import training_batch

ESTIMATOR = {"outcome": "grpo", "ktae": {"history": "prompt"}, "cscr": {}}
PLAIN = {"outcome": "grpo", "ktae": {}, "cscr": {}}


class CountingConnection(redis.asyncio.Connection):
    """One send per command or pipeline: the client's round trips."""

    sends = 0

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.sends += 1
        await super().send_packed_command(command, check_health)


@contextmanager
def redis_server() -> Iterator[str]:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        # fmt: off
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", tmp],
            stdout=subprocess.DEVNULL,
        )
        # fmt: on
        try:
            for _ in range(500):
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                    break
                except OSError:
                    time.sleep(0.01)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


async def atimed(coro: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = await coro
    return out, time.perf_counter() - start


async def run_backend(store: StatsStore, device: torch.device, visits: int) -> dict[str, Any]:
    spec = resolve_estimator(ESTIMATOR)
    rows: list[dict[str, float]] = []
    for visit in range(visits):
        batch = training_batch(seed=visit, teacher=True)
        req = ComputeRequest(batch, spec, f"bench-{visit}", "bench", client_request_id=True)
        query, t_query = timed(lambda b=batch: history_query(b), device)  # type: ignore[misc]
        CountingConnection.sends = 0
        prior, t_read = await atimed(store.read_history("bench", query))
        assert prior is not None
        ctx = TermContext(ktae_prior=prior.to(device), collect_ktae_tables=True)
        result, t_compute = timed(
            lambda c=ctx, b=batch: compute_batch(b, spec, device, context=c),  # type: ignore[misc]
            device,
        )
        _, t_plain = timed(lambda b=batch: compute_batch(b, PLAIN, device), device)  # type: ignore[misc]
        update, t_build = timed(
            lambda q=req, r=result, p=prior: build_updates(q, r, p),  # type: ignore[misc]
            device,
        )
        counted, t_write = await atimed(store.record("bench", req.request_id, update))
        assert counted
        round_trips = CountingConnection.sends
        _, t_stats = await atimed(store.token_stats("bench", "key", 100))
        assert update.history is not None
        rows.append(
            {
                "round_trips": round_trips,
                "query_s": t_query,
                "read_s": t_read,
                "compute_s": t_compute,
                "compute_without_history_s": t_plain,
                "build_s": t_build,
                "write_s": t_write,
                "token_stats_s": t_stats,
                "rows_read": float(query.tokens.size),
                "rows_written": float(update.history.tokens.size),
                "tokens_counted": float(update.tokens.tokens.size),
            }
        )
    later = rows[1:] or rows
    summary = {k: statistics.median(r[k] for r in later) for k in rows[0]}
    summary["first_visit_read_s"] = rows[0]["read_s"]
    return summary


def report(name: str, s: dict[str, Any]) -> None:
    ms = {k: 1000.0 * v for k, v in s.items() if k.endswith("_s")}
    print(f"\n== {name} ==")
    if name == "redis":
        print(f"round trips per request with history: {s['round_trips']:.0f}")
    print(
        f"response path: history query {ms['query_s']:.1f} ms + read {ms['read_s']:.1f} ms "
        f"= {ms['query_s'] + ms['read_s']:.1f} ms added to compute {ms['compute_s']:.1f} ms "
        f"({100 * (s['query_s'] + s['read_s']) / s['compute_s']:.0f}%)"
    )
    print(
        f"  (compute of the same batch without history: {ms['compute_without_history_s']:.1f} ms)"
    )
    print(
        f"write path (after the response): build {ms['build_s']:.1f} ms + write "
        f"{ms['write_s']:.1f} ms"
    )
    print(f"GET /v1/stats/tokens (order=key, limit=100): {ms['token_stats_s']:.1f} ms")
    print(
        f"sizes: {s['rows_read']:.0f} (prompt, token) rows read, {s['rows_written']:.0f} written, "
        f"{s['tokens_counted']:.0f} token ids counted"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--visits", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    results: dict[str, Any] = {"device": device.type, "torch_threads": torch.get_num_threads()}
    results["memory"] = await run_backend(MemoryStatsStore(), device, args.visits)
    report("memory", results["memory"])
    with redis_server() as url:
        store = RedisStatsStore(url, connection_class=CountingConnection)
        await store.ping()
        try:
            results["redis"] = await run_backend(store, device, args.visits)
        finally:
            await store.close()
    report("redis", results["redis"])
    print("\n" + json.dumps(results, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
