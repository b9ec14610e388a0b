"""gRPC benchmarks against a real service process on this machine.

    python bench/bench_grpc.py [--estimator ktae] [--repeats 7] [--streams 8]

Prints:
  1. end to end through GrpcClient.compute on the training-sized batch (32 groups x 16
     rollouts, about 1.09 M tokens), as a ratio to the same computation in-process in this
     run (compute_batch on the flat batch)                           (goal: <= 1.5)
     with HttpClient (Arrow) beside it, and GRPO, where the transport is nearly all the time;
  2. streaming throughput: rollouts/s with --streams concurrent StreamCompute calls, each
     sending the rollouts of a training-sized batch shuffled across its groups.

Times are medians of interleaved repeats: the machine may be shared, and the service process
competes with this one for the same cores, as a co-located trainer would.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from advantage_client import GrpcClient, HttpClient
from advantage_client.grpc_client import compute_request_message, from_tensor
from advantage_service import RolloutBatch, compute_batch
from service_process import ServiceProcess
from synthetic import training_batch

# Idle time before each timed call, so one measure's leftovers do not land on the next.
SETTLE_SECONDS = 0.2


def request_from_batch(batch: RolloutBatch, estimator: str) -> dict[str, Any]:
    """The batch as the JSON request, each rollout's tokens a numpy view (as a trainer holds
    them)."""
    tokens = batch.tokens.numpy()
    offsets = batch.offsets.numpy()
    rewards = batch.rewards.numpy()
    sizes = batch.group_sizes.tolist()
    groups = []
    start = 0
    for gid, size in zip(batch.group_ids, sizes, strict=True):
        groups.append(
            {
                "id": gid,
                "rollouts": [
                    {"tokens": tokens[offsets[i] : offsets[i + 1]], "reward": float(rewards[i])}
                    for i in range(start, start + size)
                ],
            }
        )
        start += size
    return {"estimator": estimator, "groups": groups}


def stream_rollouts(batch: RolloutBatch, seed: int) -> list[dict[str, Any]]:
    """Every rollout of the batch as a stream rollout dict, shuffled across groups."""
    request = request_from_batch(batch, "grpo")
    rollouts = [
        {
            "group_id": f"{seed}-{g['id']}",
            "group_size": len(g["rollouts"]),
            "rollout_id": f"{seed}-{g['id']}/{i}",
            **r,
        }
        for g in request["groups"]
        for i, r in enumerate(g["rollouts"])
    ]
    random.Random(seed).shuffle(rollouts)
    return rollouts


def interleaved(
    fns: dict[str, Callable[[], object]], repeats: int
) -> dict[str, tuple[float, float]]:
    """(median, best) seconds of each function, run round-robin so noise hits all alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            time.sleep(SETTLE_SECONDS)
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: (statistics.median(v), min(v)) for k, v in times.items()}


def end_to_end(service: ServiceProcess, batch: RolloutBatch, estimator: str, repeats: int) -> None:
    """Rows of the table: each measure's median and best time, and its ratio to in-process."""
    request = request_from_batch(batch, estimator)
    message = compute_request_message(request)
    grpc_client = GrpcClient(service.target, timeout=300)
    http_client = HttpClient(service.url, timeout=300)

    def stub_only() -> None:
        response = grpc_client.stub.Compute(message, timeout=300)
        from_tensor(response.advantages)

    t = interleaved(
        {
            "in-process compute_batch": lambda: compute_batch(
                batch, estimator, "cpu", diagnostics=()
            ),
            "gRPC, GrpcClient.compute": lambda: grpc_client.compute(request),
            "gRPC, stub on a built message": stub_only,
            "HTTP Arrow, HttpClient.compute": lambda: http_client.compute(request),
        },
        repeats,
    )
    # The service's own compute time: what the engine spends, without the transport.
    served = [grpc_client.compute(request)["summary"]["compute_ms"] for _ in range(3)]
    t["(server's summary.compute_ms)"] = (statistics.median(served) / 1e3, min(served) / 1e3)
    base_median, base_best = t["in-process compute_batch"]
    for name, (median, best) in t.items():
        print(
            f"| {estimator} | {name} | {median * 1e3:.1f} | {best * 1e3:.1f} | "
            f"{median / base_median:.2f}x | {best / base_best:.2f}x |"
        )
    grpc_client.close()
    http_client.close()


def streaming(service: ServiceProcess, batch: RolloutBatch, estimator: str, streams: int) -> None:
    per_stream = [stream_rollouts(batch, seed) for seed in range(streams)]
    done = [0] * streams
    errors: list[str] = []

    def run(k: int) -> None:
        client = GrpcClient(service.target)
        for result in client.stream(per_stream[k], estimator=estimator):
            if "error" in result:
                errors.append(result["error"]["message"])
            else:
                done[k] += len(result["rollouts"])
        client.close()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(streams)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} groups failed, e.g. {errors[0]}")
    rollouts = sum(done)
    tokens = streams * batch.num_tokens
    print(
        f"  {estimator:5s} {streams} streams x {batch.num_rollouts} rollouts "
        f"({batch.num_groups} groups each, shuffled): {rollouts / seconds:8.0f} rollouts/s, "
        f"{tokens / seconds / 1e6:5.2f} M tokens/s ({seconds:.2f} s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--estimator", default="ktae")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--device", default="cpu", help="the service's device")
    args = parser.parse_args()
    batch = training_batch()
    print(
        f"batch: {batch.num_groups} groups x 16 rollouts, {batch.num_tokens:,} tokens; "
        f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, service on "
        f"{args.device}"
    )
    service = ServiceProcess(device=args.device)
    try:
        print("end to end, interleaved repeats (goal: gRPC / in-process <= 1.5):")
        print("| estimator | measure | median ms | best ms | median ratio | best ratio |")
        print("|---|---|---|---|---|---|")
        for estimator in dict.fromkeys([args.estimator, "grpo"]):
            end_to_end(service, batch, estimator, args.repeats)
        print("streaming:")
        streaming(service, batch, args.estimator, args.streams)
    finally:
        service.stop()


if __name__ == "__main__":
    main()
