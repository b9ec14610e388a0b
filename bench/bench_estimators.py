"""Estimator benchmarks on the training-sized batch, measured side by side in one process.

    python bench/bench_estimators.py [--device cpu|cuda] [--repeats 9] [--threads N]
        [--skip-slow]

Prints, as ratios (the machine may be shared and noisy; ratios of interleaved runs are what
is comparable):
  1. ``compute_batch(batch, "ktae")`` with its defaults / one torch.sort of as many int64 keys
     (goal at 1 thread: <= 1.3)
  2. the ten KTAE diagnostics asked for by name / none asked for (goal at 1 thread: <= 1.7)
  3. per-group reference-structured KTAE / this KTAE          (expect >= 100)
  4. flat GRPO / padded (B, L) masked GRPO                    (goal: <= 1)
  5. peak extra memory per token of KTAE (bytes), in a fresh subprocess

``--threads``: torch's intra-op threads (0: torch's default, the machine's cores). Medians of
wall time; at one thread on the CPU also medians of the process's CPU time, which a busy
neighbour disturbs less.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from advantage_service import RolloutBatch, compute_batch
from advantage_service.estimators.ktae import STATISTICS
from ktae_per_group import ktae_scores as per_group_ktae
from synthetic import VOCAB, training_batch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    device: torch.device,
    cpu: dict[str, float] | None = None,
) -> dict[str, float]:
    """Median seconds of each function, run round-robin so noise hits all alike (and, into
    ``cpu`` when given, the medians of the process's CPU time)."""
    for fn in fns.values():  # warm-up
        fn()
    sync(device)
    times: dict[str, list[float]] = {k: [] for k in fns}
    cpu_times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - start)
            cpu_times[name].append(time.process_time() - start_cpu)
    if cpu is not None:
        cpu.update({k: statistics.median(v) for k, v in cpu_times.items()})
    return {k: statistics.median(v) for k, v in times.items()}


def padding_mask(lengths: torch.Tensor) -> torch.Tensor:
    """The (B, L) float response mask of a padded batch."""
    positions = torch.arange(int(lengths.max()), device=lengths.device)
    return (positions[None, :] < lengths[:, None]).float()


def padded_grpo(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    mask: torch.Tensor,
    num_groups: int,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO in the padded layout trainers use: the scalar broadcast over the batch's (B, L)
    response mask (which a trainer's padded batch already carries)."""
    counts = torch.bincount(group_index, minlength=num_groups).double()
    r = rewards.double()
    mean = (
        torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add_(0, group_index, r)
        / counts
    )
    sq = torch.zeros_like(mean).index_add_(0, group_index, (r - mean[group_index]) ** 2)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    single = counts == 1
    mean, std = mean.masked_fill(single, 0.0), std.masked_fill(single, 1.0)
    scores = (r - mean[group_index]) / (std[group_index] + eps)
    return scores.float()[:, None] * mask


def memory_probe(device: str) -> dict[str, float]:
    """Run in a fresh process: peak RSS growth of one KTAE call, per token."""
    batch = training_batch()
    small = training_batch(groups=2, group_size=4, max_len=64)
    compute_batch(small, "ktae", device, diagnostics=())  # load kernels
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        gpu_batch = batch.to("cuda")
        base = torch.cuda.memory_allocated()
        compute_batch(gpu_batch, "ktae", "cuda", diagnostics=())
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
    else:
        with open("/proc/self/clear_refs", "w") as handle:  # reset the peak-RSS mark
            handle.write("5")
        base = _status_kb("VmRSS")
        compute_batch(batch, "ktae", device, diagnostics=())
        extra = (_status_kb("VmHWM") - base) * 1024
    return {
        "tokens": batch.num_tokens,
        "extra_bytes": extra,
        "bytes_per_token": extra / batch.num_tokens,
    }


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--skip-slow", action="store_true", help="skip the per-group KTAE")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)"
    )
    parser.add_argument("--memory-probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_probe:
        print(json.dumps(memory_probe(args.device)))
        return
    device = torch.device(args.device)
    batch = training_batch().to(device)
    n = batch.num_tokens
    print(
        f"batch: {batch.num_groups} groups x 16 rollouts, {n:,} tokens, vocabulary {VOCAB:,}, "
        f"device {device}, torch threads {torch.get_num_threads()}"
    )

    keys = torch.randint(0, 2**40, (n,), dtype=torch.int64, device=device)

    mask = padding_mask(batch.lengths)

    def fresh() -> RolloutBatch:
        """The batch without its cached index tensors (the rollout of each token, ranks...): a
        request arrives without them, so building them is part of the measured work."""
        return RolloutBatch(
            batch.tokens, batch.offsets, batch.group_index, batch.group_ids, batch.rewards
        )

    every = ("ktae_score", *STATISTICS)
    cpu: dict[str, float] = {}
    t = interleaved(
        {
            "sort": lambda: torch.sort(keys),
            # (the defaults: no diagnostics, as a request that asks for none)
            "ktae": lambda: compute_batch(fresh(), "ktae", device),
            "ktae_diagnostics": lambda: compute_batch(fresh(), "ktae", device, diagnostics=every),
            "grpo_flat": lambda: compute_batch(fresh(), "grpo", device),
            "grpo_padded": lambda: padded_grpo(
                batch.rewards, batch.group_index, mask, batch.num_groups
            ),
            "grpo_padded_mask": lambda: padded_grpo(
                batch.rewards, batch.group_index, padding_mask(batch.lengths), batch.num_groups
            ),
        },
        args.repeats,
        device,
        cpu,
    )
    rows = [
        ("torch.sort of N int64 keys", "sort"),
        ("KTAE, compute_batch defaults", "ktae"),
        ("KTAE + its ten diagnostics", "ktae_diagnostics"),
        ("GRPO, flat ragged", "grpo_flat"),
        ("GRPO, padded (B, L), mask given", "grpo_padded"),
        ("GRPO, padded, mask from lengths", "grpo_padded_mask"),
    ]
    single = device.type == "cpu" and torch.get_num_threads() == 1
    for name, key in rows:
        cpu_ms = f"   (CPU {cpu[key] * 1e3:.2f} ms)" if single else ""
        print(f"  {name:34s} {t[key] * 1e3:9.2f} ms{cpu_ms}")

    def also_cpu(num: str, den: str) -> str:
        return f"; CPU time {cpu[num] / cpu[den]:.2f}" if single else ""

    print(
        f"KTAE (defaults) / sort      = {t['ktae'] / t['sort']:.2f}{also_cpu('ktae', 'sort')}"
        "   (goal <= 1.3 at 1 thread)"
    )
    print(
        f"ten diagnostics / none      = {t['ktae_diagnostics'] / t['ktae']:.2f}"
        f"{also_cpu('ktae_diagnostics', 'ktae')}   (goal <= 1.7 at 1 thread)"
    )
    print(
        f"GRPO flat / padded          = {t['grpo_flat'] / t['grpo_padded']:.2f} with the mask "
        f"given, {t['grpo_flat'] / t['grpo_padded_mask']:.2f} with the mask built from the "
        "lengths   (goal <= 1)"
    )

    if not args.skip_slow:
        cpu = batch.to("cpu")
        arrays = (
            cpu.tokens.numpy().astype(np.int64),
            cpu.offsets.numpy(),
            cpu.group_index.numpy(),
            cpu.rewards.numpy(),
        )
        start = time.perf_counter()
        slow = per_group_ktae(*arrays, vocab=VOCAB)
        slow_s = time.perf_counter() - start
        fast = compute_batch(cpu, "ktae", "cpu", diagnostics=("ktae_score",))
        worst = float(np.abs(fast.diagnostics["ktae_score"].numpy() - slow).max())
        print(
            f"per-group KTAE (reference structure) {slow_s:8.2f} s; "
            f"ratio to this KTAE = {slow_s / t['ktae']:.0f}x (max |score diff| {worst:.1e})"
        )

    probe = subprocess.run(
        [
            sys.executable,
            __file__,
            "--memory-probe",
            "--device",
            args.device,
            "--threads",
            str(args.threads),
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ},
    )
    mem = json.loads(probe.stdout.strip().splitlines()[-1])
    print(
        f"KTAE peak extra memory      = {mem['bytes_per_token']:.0f} bytes/token "
        f"({mem['extra_bytes'] / 2**20:.0f} MiB for {mem['tokens']:,} tokens)"
    )


if __name__ == "__main__":
    main()
