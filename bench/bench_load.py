"""Sustained load against a real service process, with fault injections.

16 clients (default) for 60 s (default) on mid-sized batches (8 groups x 8 rollouts x 256-768
tokens, KTAE): half over HTTP (Arrow), half over gRPC (unary and streaming). Two scenarios:

- ``steady``: the embedded stats store; latency percentiles, throughput, and the server's RSS
  sampled every half second (start = the end of warm-up, peak and end after it);
- ``faults``: a real redis-server and KTAE history on; Redis is killed at 1/3 of the run and
  started again at 1/2; SIGTERM near the end (5 s before). Every request sent before SIGTERM
  must be answered 200; later ones are served or refused cleanly (counted as "refused after
  shutdown", not failures); the process must exit 0.

    python bench/bench_load.py [--duration 60] [--clients 16] [--scenario steady|faults|all]

Prints one JSON summary per scenario and a markdown table of the numbers the README records.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests"))

from loadgen import Load, LoadConfig, RssSampler, Shape, rss_summary, summarize  # noqa: E402
from service_process import ServiceProcess  # noqa: E402
from stats.redis_support import RedisServer  # noqa: E402

KTAE = "ktae"
KTAE_HISTORY = {"outcome": "grpo", "ktae": {"history": "prompt"}}


def run_scenario(name: str, args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    redis = RedisServer(directory / "redis") if name == "faults" else None
    settings: dict[str, Any] = {"log_format": "json", "shutdown_delay_seconds": 1}
    if redis is not None:
        redis.start()
        settings["redis_url"] = redis.url
    service = ServiceProcess(settings=settings, log=directory / "service.log", log_level="info")
    shape = Shape(args.groups, args.rollouts, args.tokens)
    load = Load(
        LoadConfig(
            http_url=service.url,
            grpc_target=service.target,
            clients=args.clients,
            shape=shape,
            estimator=KTAE_HISTORY if redis is not None else KTAE,
        )
    )
    sampler = RssSampler(service.proc.pid)
    events: dict[str, float] = {}
    start = time.monotonic()
    sampler.start()
    load.start()
    exit_code: int | None = None
    try:
        duration = args.duration
        if redis is None:
            time.sleep(duration)
        else:
            kill_at, restart_at, sigterm_at = duration / 3, duration / 2, duration - 5
            time.sleep(kill_at)
            redis.kill()
            events["redis_killed_s"] = round(time.monotonic() - start, 1)
            time.sleep(restart_at - kill_at)
            redis.start()
            events["redis_restarted_s"] = round(time.monotonic() - start, 1)
            time.sleep(sigterm_at - restart_at)
            load.mark_shutdown()
            events["sigterm_s"] = round(time.monotonic() - start, 1)
            exit_code = service.stop(120)
            events["exited_s"] = round(time.monotonic() - start, 1)
            time.sleep(max(0.0, duration - (time.monotonic() - start)))
    finally:
        end = time.monotonic()
        load.stop()
        sampler.stop()
        if service.proc.poll() is None:
            exit_code = service.stop(120)
        if redis is not None:
            redis.stop()
    summary = summarize(load.results, start, end, load.shutdown_at)
    tokens_per_request = shape.groups * shape.rollouts * shape.tokens
    summary.update(
        scenario=name,
        clients=args.clients,
        batch=f"{shape.groups} groups x {shape.rollouts} rollouts x {shape.tokens // 2}-"
        f"{shape.tokens * 3 // 2} tokens ({tokens_per_request} on average)",
        tokens_per_s=round(summary["all"]["per_s"] * tokens_per_request),
        rss=rss_summary(sampler.samples, start + args.warmup),
        rss_samples=len(sampler.samples),
        exit_code=exit_code,
        events=events,
        log=str(service.log),
    )
    return summary


def table(summaries: list[dict[str, Any]]) -> str:
    rows = [
        "| scenario | requests ok | failed | refused after shutdown | p50 ms | p99 ms | "
        "requests/s | tokens/s | RSS start / peak / end MiB | exit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        outcomes = s["outcomes"]
        rss = s["rss"]
        rows.append(
            f"| {s['scenario']} | {outcomes.get('ok', 0)} | {outcomes.get('failed', 0)} | "
            f"{outcomes.get('refused', 0)} | {s['all']['p50_ms']} | {s['all']['p99_ms']} | "
            f"{s['all']['per_s']} | {s['tokens_per_s']:,} | "
            f"{rss['start_mib']} / {rss['peak_mib']} / {rss['end_mib']} | {s['exit_code']} |"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per scenario")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512, help="mean tokens per rollout")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before RSS start")
    parser.add_argument("--scenario", choices=["steady", "faults", "all"], default="all")
    parser.add_argument("--json", type=Path, help="also write the summaries here")
    args = parser.parse_args()
    names = ["steady", "faults"] if args.scenario == "all" else [args.scenario]
    summaries = []
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        for name in names:
            directory = Path(tmp) / name
            directory.mkdir()
            summary = run_scenario(name, args, directory)
            summary.pop("log")
            print(json.dumps(summary, indent=2), flush=True)
            summaries.append(summary)
    print(table(summaries))
    if args.json:
        args.json.write_text(json.dumps(summaries, indent=2))
    ok = all(
        s["outcomes"].get("failed", 0) == 0
        and s["before_shutdown_not_ok"] == 0
        and s["exit_code"] == 0
        for s in summaries
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
