"""Stats-store cost per request on the training-sized batch, for both backends.

    python bench/bench_stats.py [--device cpu|cuda|auto] [--visits 8] [--repeats 3] [--threads N]
        [--backends memory,redis,redis-zstd]

The batch: 32 groups x 16 rollouts x up to 4096 tokens (~1.1M tokens, ~480k distinct (prompt,
token) pairs), Zipf ids over 151,936 (synthetic.py), estimator GRPO + KTAE with per-prompt
history + CSCR, the same 32 prompt ids on every visit with fresh rollouts, so each prompt's
stored history grows over the visits until pruning bounds it (~10 visits at decay 0.5). It starts
its own redis-server on a free port in a temporary directory (never the shared one).

Requests go through the service's engine in-process (``Engine.compute``: admission, a compute
worker, the history read, the summary; no HTTP), so the response time is the one a client
waits for, the history read overlapping KTAE's tabulation as it does in the service. Four
measurements of each visit's batch run interleaved ``--repeats`` times, each after the previous
request's statistics writes have finished (they run after the answer and would otherwise
compete for the cores):

  - ``response``: the engine's response time for the request with history (read + compute);
  - ``compute``: the same computation with the prior already in hand (no store, no engine);
  - ``plain response``: the engine's response time for the same request without history (its
    statistics are still written, after the answer);
  - ``plain compute``: the computation without history.

Prints per backend, medians over the visits after the first (history present):
  - Redis round trips per request with history (sends on the client's connections: one per
    command or pipeline; must be 2), and how often a write triggered a compaction;
  - ``response / compute``: the latency history and statistics add to the computation the
    request asks for (the issue's goal: <= 1.3); ``response / plain response``: what asking for
    history costs in all, the merged statistics' own compute included (with history every
    group is scored: a group without both correct and wrong rollouts in this batch has them in
    its history); the read alone, not overlapped;
  - the write path (scheduled after the response): building the updates + the write (and the
    compactions, separately);
  - reading the vocabulary statistics back (order=key, limit=100);
  - redis-server's main-thread CPU per read and per write (while it runs one client's
    commands it serves no other client);
  - sizes: (prompt, token) tables looked up, stored history rows read and written.

Pass --threads 1 on a machine with few cores: torch's intra-op threads then do not fight
redis-server and the event loop for the cores, and the timings are stable.

``--writer``: only the writer's cost, quickly (no engine, no Redis): per visit, the request's
statistics update (``StateSession.update``: the history records and the vocabulary statistics,
what the writer's worker builds after the answer) against its computation (given its prior),
timed interleaved ``--repeats`` times, wall and CPU time; the ratio of the medians over the
visits after the first (goal: update <= 0.5x the computation). With ``--plain`` the request is
plain GRPO (no history: the update is the vocabulary statistics alone, counted from the batch).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis
import redis.asyncio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from advantage_service import compute_batch
from advantage_service.config import Settings
from advantage_service.estimators import TermContext, resolve_device, resolve_estimator
from advantage_service.estimators.ktae_history import (
    SPACE,
    HistoryPrior,
    decode_history,
    prompt_ids,
)
from advantage_service.estimators.state import Compression, PendingRead, WriteOptions
from advantage_service.observability.metrics import Metrics
from advantage_service.serving.engine import Engine
from advantage_service.serving.term_state import StateSession
from advantage_service.stats import MemoryStatsStore, RedisStatsStore, StatsStore
from advantage_service.wire.request import ComputeRequest
from stats.redis_support import RedisServer
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
    """A fresh redis-server on a free port in a temporary directory (the tests' own helper)."""
    with tempfile.TemporaryDirectory(prefix="bench-stats-") as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        try:
            yield server.url
        finally:
            server.stop()


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


# A worker thread of the benchmark's own, as the engine's compute workers are: the computation
# given its prior runs off the event loop, like a request's.
WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-compute")


async def on_worker(engine: Engine, fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds ``fn`` takes on a worker thread (as a request computes on the engine's)."""
    loop = asyncio.get_running_loop()
    return float(await loop.run_in_executor(WORKER, lambda: timed(fn, device)[1]))


def history_record_bytes(url: str | None) -> float:
    """Mean size of the KTAE history records in Redis (0 without Redis)."""
    if url is None:
        return 0.0
    client = redis.Redis.from_url(url)
    sizes = [int(client.strlen(key)) for key in client.scan_iter(match="*:history:*")]
    client.close()
    return statistics.fmean(sizes) if sizes else 0.0


async def read_prior(
    store: StatsStore, prompts: list[str], device: torch.device
) -> HistoryPrior | None:
    """The key-token prior of ``prompts``, as a request reads it (records, then decoded)."""
    records = await store.read_records("bench", [(SPACE, p) for p in prompts])
    return None if records is None else HistoryPrior.decode(records, device)


async def run_backend(
    store: StatsStore,
    device: torch.device,
    visits: int,
    repeats: int,
    ops: dict[str, list[float]],
    url: str | None = None,
    compression: Compression = "none",
) -> dict[str, Any]:
    spec = resolve_estimator(ESTIMATOR)
    plain_spec = resolve_estimator(PLAIN)
    settings = Settings(device=device.type, max_inflight=2, stats_compression=compression)
    engine = Engine(settings, Metrics(process=False))
    engine.store = store
    engine.warm_up()
    rows: list[dict[str, float]] = []
    compactions = 0
    cpu = redis_cpu(url)
    for visit in range(visits):
        batch = training_batch(seed=visit, teacher=True).to(device)
        # One request id per visit: the first response counts (history and statistics), the
        # repeats are computed and answered alike but counted once, so history moves one visit.
        req = ComputeRequest(batch, spec, f"bench-{visit}", "bench", client_request_id=True)
        plain_req = ComputeRequest(batch, plain_spec, f"plain-{visit}", "bench")
        prompts = prompt_ids(batch)
        before_trips, before_compactions = CountingConnection.sends, len(ops["compact"])
        times: dict[str, list[float]] = defaultdict(list)
        for repeat in range(repeats):
            start = time.perf_counter()
            computed = await engine.compute(req, "bench")
            times["response"].append(time.perf_counter() - start)
            # (the first visit reads nothing stored yet)
            expected = "applied" if visit or repeat else "empty"
            assert computed.summary is not None and computed.summary["history"] == expected
            await engine.settle_writes()
            if repeat == 0:
                compacted = len(ops["compact"]) > before_compactions
                compactions += compacted
                trips = CountingConnection.sends - before_trips - (2 if compacted else 0)
            prior = await read_prior(store, prompts, device)
            assert prior is not None
            ctx = TermContext(reads={"ktae": PendingRead.of(prior)})
            t = await on_worker(
                engine,
                lambda b=batch, c=ctx: compute_batch(b, spec, device, context=c, diagnostics=()),
                device,
            )  # type: ignore[misc]
            times["compute"].append(t)
            start = time.perf_counter()
            await engine.compute(plain_req, "bench")
            times["plain_response"].append(time.perf_counter() - start)
            await engine.settle_writes()
            t = await on_worker(
                engine, lambda b=batch: compute_batch(b, plain_spec, device, diagnostics=()), device
            )  # type: ignore[misc]
            times["plain_compute"].append(t)
        # The read alone (records and their decoding) and the write path, on a request of their
        # own (counted once more), through the engine's state session.
        extra = ComputeRequest(batch, spec, f"write-{visit}", "bench", client_request_id=True)
        cpu_start = cpu()
        session = StateSession(store, extra, device, engine.write_options)
        history, t_read = await atimed(session.settle())
        cpu_read = cpu() - cpu_start
        assert history == "applied"
        read = session.context.reads["ktae"]
        prior = read.result()
        assert prior is not None
        result = compute_batch(batch, spec, device, context=session.context, diagnostics=())
        update, t_build = timed(functools.partial(session.update, result), device)
        compact_before = len(ops["compact"])
        cpu_start = cpu()
        counted, t_write = await atimed(session.record(update))
        cpu_write = cpu() - cpu_start
        assert counted
        t_compact = ops["compact"][-1] if len(ops["compact"]) > compact_before else 0.0
        _, t_stats = await atimed(store.token_stats("bench", "key", 100))
        assert update.records
        written = [decode_history(record) for record in update.records.values()]
        median = {k: statistics.median(v) for k, v in times.items()}
        tables = result.state["ktae"].tables
        rows.append(
            {
                "round_trips": float(trips),
                **{f"{k}_s": v for k, v in median.items()},
                "read_s": t_read,
                "build_s": t_build,
                "write_s": t_write - t_compact,
                "token_stats_s": t_stats,
                "redis_cpu_read_s": cpu_read,
                "redis_cpu_write_s": cpu_write,
                "tables": float(tables.group.numel()),
                "stored_rows_read": float(prior.rows),
                "stored_rows_written": float(sum(h.rows for h in written if h is not None)),
                "tokens_counted": float(update.tokens.tokens.size),
            }
        )
    engine.close()
    history_bytes = history_record_bytes(url)
    later = rows[1:] or rows
    summary: dict[str, Any] = {k: statistics.median(r[k] for r in later) for k in rows[0]}
    for name, num, den in (
        ("ratio_compute", "response_s", "compute_s"),
        ("ratio_plain_response", "response_s", "plain_response_s"),
        ("ratio_compute_plain", "compute_s", "plain_compute_s"),
    ):
        summary[name] = statistics.median(r[num] / r[den] for r in later)
    summary["first_visit_read_s"] = rows[0]["read_s"]
    summary["last_visit"] = rows[-1]
    summary["compactions"] = compactions
    summary["history_bytes_per_prompt"] = history_bytes
    summary["compact_s"] = statistics.median(ops["compact"]) if ops["compact"] else 0.0
    return summary


async def writer_cost(
    device: torch.device, visits: int, repeats: int, compression: Compression, plain: bool
) -> dict[str, float]:
    """The writer's cost per request against the request's computation (see the module's
    docstring, ``--writer``): medians in seconds, and their ratios."""
    spec = resolve_estimator("grpo" if plain else ESTIMATOR)
    store = MemoryStatsStore()
    rows: list[dict[str, float]] = []
    for visit in range(visits):
        batch = training_batch(seed=visit, teacher=True).to(device)
        req = ComputeRequest(batch, spec, f"writer-{visit}", "bench", client_request_id=True)
        session = StateSession(store, req, device, WriteOptions(compression))
        await session.settle()
        ctx = session.context
        result = compute_batch(batch, spec, device, context=ctx)
        times: dict[str, list[float]] = defaultdict(list)
        for _ in range(repeats):
            for name, fn in (
                ("compute", lambda b=batch, c=ctx: compute_batch(b, spec, device, context=c)),
                ("update", lambda s=session, r=result: s.update(r)),
            ):
                start_cpu = time.process_time()
                _, seconds = timed(fn, device)  # type: ignore[arg-type]
                times[name].append(seconds)
                times[f"{name}_cpu"].append(time.process_time() - start_cpu)
        assert await session.record(session.update(result))
        rows.append({k: statistics.median(v) for k, v in times.items()})
    later = rows[1:] or rows
    out = {k: statistics.median(r[k] for r in later) for k in rows[0]}
    out["ratio"] = out["update"] / out["compute"]
    out["ratio_cpu"] = out["update_cpu"] / out["compute_cpu"]
    return out


def report(name: str, s: dict[str, Any], visits: int) -> None:
    ms = {k: 1000.0 * v for k, v in s.items() if k.endswith("_s")}
    print(f"\n== {name} ==")
    if name.startswith("redis"):
        print(f"round trips per request with history: {s['round_trips']:.0f}")
        print(
            f"compactions: {s['compactions']} in {visits} writes, {ms['compact_s']:.1f} ms each "
            "(2 round trips, after the answer, by the one replica holding the lock)"
        )
    print(
        f"response with history {ms['response_s']:.1f} ms, its compute {ms['compute_s']:.1f} ms: "
        f"response / compute {s['ratio_compute']:.2f}x (goal <= 1.3)"
    )
    print(
        f"response without history {ms['plain_response_s']:.1f} ms, its compute "
        f"{ms['plain_compute_s']:.1f} ms: response with / without history "
        f"{s['ratio_plain_response']:.2f}x; compute with / without {s['ratio_compute_plain']:.2f}x"
    )
    print(f"the read alone (not overlapped): {ms['read_s']:.1f} ms")
    print(
        f"write path (after the response): build {ms['build_s']:.1f} ms + write "
        f"{ms['write_s']:.1f} ms"
    )
    print(f"GET /v1/stats/tokens (order=key, limit=100): {ms['token_stats_s']:.1f} ms")
    if name.startswith("redis"):
        print(f"history record in Redis: {s['history_bytes_per_prompt'] / 1e6:.2f} MB per prompt")
        print(
            f"redis-server CPU per request: read {ms['redis_cpu_read_s']:.1f} ms, write "
            f"{ms['redis_cpu_write_s']:.1f} ms (main-thread time taken from every other client)"
        )
    last = s["last_visit"]
    print(
        f"sizes (median; last visit): {s['tables']:.0f} (prompt, token) tables looked up, "
        f"{s['stored_rows_read']:.0f} ({last['stored_rows_read']:.0f}) stored rows read, "
        f"{s['stored_rows_written']:.0f} ({last['stored_rows_written']:.0f}) written, "
        f"{s['tokens_counted']:.0f} token ids counted"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--visits", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved computations")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)"
    )
    parser.add_argument(
        "--backends",
        default="memory,redis,redis-zstd",
        help="comma-separated: memory, redis, redis-zstd (Redis with compressed history)",
    )
    parser.add_argument(
        "--writer", action="store_true", help="only the writer's update against the computation"
    )
    parser.add_argument(
        "--plain",
        action="store_true",
        help="with --writer: plain GRPO (vocabulary statistics only)",
    )
    parser.add_argument("--compression", default="none", choices=("none", "zstd"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    results: dict[str, Any] = {"device": device.type, "torch_threads": torch.get_num_threads()}
    if args.writer:
        cost = await writer_cost(device, args.visits, args.repeats, args.compression, args.plain)
        ms = {k: 1000.0 * v for k, v in cost.items() if not k.startswith("ratio")}
        what = "plain GRPO" if args.plain else f"history records {args.compression}"
        goal = "" if args.plain else "; goal <= 0.5"  # (the goal is the request with history's)
        print(
            f"writer, {results['torch_threads']} torch threads, {device.type}, {what}: update "
            f"{ms['update']:.1f} ms (CPU {ms['update_cpu']:.1f}), its "
            f"computation {ms['compute']:.1f} ms (CPU {ms['compute_cpu']:.1f}): update / "
            f"computation {cost['ratio']:.2f}x (CPU time {cost['ratio_cpu']:.2f}x{goal})"
        )
        print(json.dumps({**results, "writer": cost}, indent=1))
        return
    for backend in args.backends.split(","):
        if backend == "memory":
            results[backend] = await run_backend(
                MemoryStatsStore(), device, args.visits, args.repeats, defaultdict(list)
            )
            report(backend, results[backend], args.visits)
            continue
        ops: dict[str, list[float]] = defaultdict(list)
        with redis_server() as url:  # a fresh server per backend: its memory is this one's
            store = RedisStatsStore(
                url,
                connection_class=CountingConnection,
                on_duration=lambda op, seconds, ops=ops: ops[op].append(seconds),  # type: ignore[misc]
            )
            await store.ping()
            try:
                compression: Compression = "zstd" if backend == "redis-zstd" else "none"
                results[backend] = await run_backend(
                    store, device, args.visits, args.repeats, ops, url, compression
                )
            finally:
                await store.close()
        report(backend, results[backend], args.visits)
    print("\n" + json.dumps(results, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
