"""Dynamic batching on the device: 32 small requests computed one by one against the same 32
computed as one merged batch (what the scheduler does when they wait together), interleaved.

    python bench/bench_merge.py [--device cpu|cuda] [--requests 32] [--repeats 9]

Each request: 4 groups x 8 rollouts x 256-768 tokens (Zipf ids), the trainer fleet's small
request. Timed per estimator (GRPO, KTAE): one by one (``compute_request`` per request, each
result moved to the host as an encoder would), merged (``merging.merge`` + one computation +
``merging.split``, the results moved to the host), and the ratio one-by-one / merged (the
issue's goal on a GPU: at least 2x). The merged answers are checked equal to the one-by-one
ones (bit for bit on the CPU, to float32 rounding on CUDA).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from advantage_service.estimators import resolve_device
from advantage_service.serving.compute import compute_request
from advantage_service.serving.merging import merge, split
from advantage_service.wire.request import ComputeRequest, parse_request
from loadgen import Shape, make_request

SHAPE = Shape(groups=4, rollouts=8, tokens=512)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    device = resolve_device(args.device)
    print(f"device {device}, torch threads {torch.get_num_threads()}, {args.requests} requests")
    for estimator in ("grpo", "ktae"):
        reqs = [
            parse_request(
                make_request(i, SHAPE, estimator=estimator, namespace=f"ns{i % 4}", prompts=64)
            )
            for i in range(args.requests)
        ]
        tokens = sum(r.batch.num_tokens for r in reqs)

        def one_by_one(reqs: list[ComputeRequest] = reqs) -> list[np.ndarray]:
            return [compute_request(r, device).advantages.cpu().numpy() for r in reqs]

        def merged(reqs: list[ComputeRequest] = reqs) -> list[np.ndarray]:
            batch = merge(reqs)
            whole = compute_request(replace(reqs[0], batch=batch), device)
            return [part.advantages.cpu().numpy() for part in split(whole, batch)]

        for got, want in zip(merged(), one_by_one(), strict=True):
            if device.type == "cpu":
                assert np.array_equal(got, want)
            else:
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        times: dict[str, list[float]] = {"one_by_one": [], "merged": []}
        for _ in range(args.repeats):
            for name, fn in (("one_by_one", one_by_one), ("merged", merged)):
                sync(device)
                start = time.perf_counter()
                fn()
                sync(device)
                times[name].append(time.perf_counter() - start)
        alone = statistics.median(times["one_by_one"])
        together = statistics.median(times["merged"])
        print(
            f"{estimator}: {tokens:,} tokens; one by one {alone * 1000:.1f} ms, merged "
            f"{together * 1000:.1f} ms: one by one / merged {alone / together:.2f}x"
        )


if __name__ == "__main__":
    main()
