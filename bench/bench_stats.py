"""Stats-store cost per request on the training-sized batch, for both backends.

    python bench/bench_stats.py [--device cpu|cuda|auto] [--visits 12] [--repeats 3] [--threads N]

The batch: 32 groups x 16 rollouts x up to 4096 tokens (~1.1M tokens, ~480k distinct (prompt,
token) pairs), Zipf ids over 151,936 (synthetic.py), estimator GRPO + KTAE with per-prompt
history + CSCR, the same 32 prompt ids on every visit with fresh rollouts, so each prompt's
stored history grows over the visits until pruning bounds it (~10 visits at decay 0.5). It starts
its own redis-server on a free port in a temporary directory (never the shared one).

Prints per backend, medians over the visits after the first (history present):
  - Redis round trips per request with history (sends on the client's connections: one per
    command or pipeline; must be 2), and how often a write triggered a compaction;
  - the response path against the compute time. Three computations of each visit's batch run
    interleaved ``--repeats`` times: ``plain`` (no history, no statistics), ``+tables`` (the KTAE
    tables the statistics need) and ``+history`` (with the prior, what a request with history
    computes). ``with / plain`` = (history query + read + ``+history``) / ``plain``: the
    response time with history and statistics as a ratio to the compute without either (the
    issue's goal: <= 1.3); ``with / +tables``: the same against the compute the service does
    without history (it collects the tables for the statistics anyway);
  - the write path (scheduled after the response): building the updates + the write (and the
    compactions, separately);
  - reading the vocabulary statistics back (order=key, limit=100);
  - redis-server's main-thread CPU per read and per write (while it runs one client's
    commands it serves no other client);
  - sizes: (prompt, token) pairs queried, stored history rows read and written, MB moved.

Pass --threads 1 on a machine with few cores: torch's intra-op threads then do not fight
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
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis
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


def history_sizes(prior: Any, update: Any) -> dict[str, float]:
    """Stored rows read and written (this layout: whole records per prompt)."""
    stored = getattr(prior, "stored", None)
    prompts = getattr(update.history, "prompts", None)
    if stored is None or prompts is None:  # a layout that reads only the queried rows
        rows = float(update.history.tokens.size)
        return {"stored_rows_read": float(prior.keys.numel()), "stored_rows_written": rows}
    return {
        "stored_rows_read": float(sum(h.rows for h in stored if h is not None)),
        "stored_rows_written": float(sum(h.rows for h in prompts)),
    }


def redis_cpu(url: str | None) -> Callable[[], float]:
    """Seconds of CPU the redis-server's main thread has used so far (0 without Redis)."""
    if url is None:
        return lambda: 0.0
    client = redis.Redis.from_url(url)

    def used() -> float:
        info = client.info("cpu")
        return float(
            info.get("used_cpu_sys_main_thread", info["used_cpu_sys"])
            + info.get("used_cpu_user_main_thread", info["used_cpu_user"])
        )

    return used


async def run_backend(
    store: StatsStore,
    device: torch.device,
    visits: int,
    repeats: int,
    ops: dict[str, list[float]],
    url: str | None = None,
) -> dict[str, Any]:
    spec = resolve_estimator(ESTIMATOR)
    plain_spec = resolve_estimator(PLAIN)
    rows: list[dict[str, float]] = []
    compactions = 0
    cpu = redis_cpu(url)
    for visit in range(visits):
        batch = training_batch(seed=visit, teacher=True).to(device)
        req = ComputeRequest(batch, spec, f"bench-{visit}", "bench", client_request_id=True)
        query, t_query = timed(lambda b=batch: history_query(b), device)  # type: ignore[misc]
        CountingConnection.sends = 0
        cpu_start = cpu()
        prior, t_read = await atimed(store.read_history("bench", query))
        cpu_read = cpu() - cpu_start
        assert prior is not None
        read_trips = CountingConnection.sends
        on_device = prior.to(device)
        times: dict[str, list[float]] = defaultdict(list)
        result = None
        for _ in range(repeats):
            for name, s, ctx in (
                ("plain", plain_spec, TermContext()),
                ("tables", plain_spec, TermContext(collect_ktae_tables=True)),
                ("history", spec, TermContext(ktae_prior=on_device, collect_ktae_tables=True)),
            ):
                out, t = timed(
                    lambda b=batch, s=s, c=ctx: compute_batch(b, s, device, context=c),  # type: ignore[misc]
                    device,
                )
                times[name].append(t)
                if name == "history":
                    result = out
        assert result is not None
        update, t_build = timed(
            lambda q=req, r=result, p=prior: build_updates(q, r, p),  # type: ignore[misc]
            device,
        )
        compact_before = len(ops["compact"])
        CountingConnection.sends = 0
        cpu_start = cpu()
        counted, t_write = await atimed(store.record("bench", req.request_id, update))
        cpu_write = cpu() - cpu_start
        assert counted
        compacted = len(ops["compact"]) > compact_before
        compactions += compacted
        write_trips = CountingConnection.sends - (2 if compacted else 0)
        t_compact = ops["compact"][-1] if compacted else 0.0
        _, t_stats = await atimed(store.token_stats("bench", "key", 100))
        assert update.history is not None
        compute = {k: statistics.median(v) for k, v in times.items()}
        rows.append(
            {
                "round_trips": float(read_trips + write_trips),
                "query_s": t_query,
                "read_s": t_read,
                "compute_plain_s": compute["plain"],
                "compute_tables_s": compute["tables"],
                "compute_history_s": compute["history"],
                "build_s": t_build,
                "write_s": t_write - t_compact,
                "token_stats_s": t_stats,
                "redis_cpu_read_s": cpu_read,
                "redis_cpu_write_s": cpu_write,
                "pairs_queried": float(query.tokens.size),
                **history_sizes(prior, update),
                "tokens_counted": float(update.tokens.tokens.size),
            }
        )
    later = rows[1:] or rows
    summary: dict[str, Any] = {k: statistics.median(r[k] for r in later) for k in rows[0]}
    for name, base in (("ratio_plain", "compute_plain_s"), ("ratio_tables", "compute_tables_s")):
        summary[name] = statistics.median(
            (r["query_s"] + r["read_s"] + r["compute_history_s"]) / r[base] for r in later
        )
    summary["first_visit_read_s"] = rows[0]["read_s"]
    summary["last_visit"] = rows[-1]
    summary["compactions"] = compactions
    summary["compact_s"] = statistics.median(ops["compact"]) if ops["compact"] else 0.0
    return summary


def report(name: str, s: dict[str, Any], visits: int) -> None:
    ms = {k: 1000.0 * v for k, v in s.items() if k.endswith("_s")}
    print(f"\n== {name} ==")
    if name == "redis":
        print(f"round trips per request with history: {s['round_trips']:.0f}")
        print(
            f"compactions: {s['compactions']} in {visits} writes, {ms['compact_s']:.1f} ms each "
            "(2 round trips, after the answer, by the one replica holding the lock)"
        )
    added = ms["query_s"] + ms["read_s"] + ms["compute_history_s"]
    print(
        f"response path: history query {ms['query_s']:.1f} ms + read {ms['read_s']:.1f} ms + "
        f"compute with history {ms['compute_history_s']:.1f} ms = {added:.1f} ms"
    )
    print(
        f"  compute without history: {ms['compute_plain_s']:.1f} ms plain, "
        f"{ms['compute_tables_s']:.1f} ms with the statistics' KTAE tables"
    )
    print(
        f"  with / plain: {s['ratio_plain']:.2f}x (goal <= 1.3), with / +tables: "
        f"{s['ratio_tables']:.2f}x (medians per visit)"
    )
    print(
        f"write path (after the response): build {ms['build_s']:.1f} ms + write "
        f"{ms['write_s']:.1f} ms"
    )
    print(f"GET /v1/stats/tokens (order=key, limit=100): {ms['token_stats_s']:.1f} ms")
    if name == "redis":
        print(
            f"redis-server CPU per request: read {ms['redis_cpu_read_s']:.1f} ms, write "
            f"{ms['redis_cpu_write_s']:.1f} ms (main-thread time taken from every other client)"
        )
    last = s["last_visit"]
    print(
        f"sizes (median; last visit): {s['pairs_queried']:.0f} (prompt, token) pairs queried, "
        f"{s['stored_rows_read']:.0f} ({last['stored_rows_read']:.0f}) stored rows read, "
        f"{s['stored_rows_written']:.0f} ({last['stored_rows_written']:.0f}) written, "
        f"{s['tokens_counted']:.0f} token ids counted"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--visits", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved computations")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    results: dict[str, Any] = {"device": device.type, "torch_threads": torch.get_num_threads()}
    results["memory"] = await run_backend(
        MemoryStatsStore(), device, args.visits, args.repeats, defaultdict(list)
    )
    report("memory", results["memory"], args.visits)
    ops: dict[str, list[float]] = defaultdict(list)
    with redis_server() as url:
        store = RedisStatsStore(
            url,
            connection_class=CountingConnection,
            on_duration=lambda op, seconds: ops[op].append(seconds),
        )
        await store.ping()
        try:
            results["redis"] = await run_backend(store, device, args.visits, args.repeats, ops, url)
        finally:
            await store.close()
    report("redis", results["redis"], args.visits)
    print("\n" + json.dumps(results, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
