"""MaxRL, HICRA, GTPO and GRPO-S against GRPO on the training-sized batch, in one process.

    python bench/bench_new_methods.py [--repeats 15] [--threads 1]

The batch is bench/synthetic.py's: 32 groups x 16 rollouts (512), lengths uniform in
[1, 4096], about 1.09 M tokens, 0/1 rewards with about half the groups mixed; entropies drawn
from a gamma distribution and a planning mask on about 15% of the tokens. Each estimator is
``compute_batch`` on a fresh batch (no cached index tensors, as a request arrives) returning
advantages and scalars only, timed in interleaved rounds (the machine may be shared and
noisy: each round shuffles the order and times each estimator's second call in a row); the
figures are medians, and the fastest rounds, with their ratios to GRPO's. Goals: maxrl and
hicra (GRPO plus HICRA) at most 1.5x GRPO, gtpo and grpo_s at most 3x.

Two references are timed beside them (not goals): one scatter-add of the entropies by (class,
group, position), what GTPO's keyed path (any device; on the CPU the cases of entropies of 0)
pays for each of its per-position sums, and which the compiled CPU loops do without; and one
pass reading the planning mask into a fresh array, what HICRA reads besides what GRPO writes.

Also printed (once, not a goal): finding the planning tokens from strategic phrases in the
batch's decoded text, with a synthetic 151,936-entry vocabulary (what a server with
``--tokenizer`` does for a request without ``planning_mask``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from advantage_service import RolloutBatch, compute_batch
from advantage_service.estimators.gtpo import key_layout, split_classes, token_keys
from advantage_service.estimators.hicra import strategic_phrase_mask
from synthetic import VOCAB, training_batch

ESTIMATORS = ("grpo", "maxrl", "hicra", "gtpo", "grpo_s")
SCATTER = "scatter"  # one index_add_ of the N entropies by (class, group, position): the keyed path
MASK_PASS = "mask pass"  # one pass reading the planning mask into a fresh array: a reference
GOALS = {"maxrl": 1.5, "hicra": 1.5, "gtpo": 3.0, "grpo_s": 3.0}


def interleaved(
    fns: dict[str, Callable[[], object]], repeats: int
) -> dict[str, tuple[float, float, float]]:
    """(median, fastest, median CPU) seconds of each function, run round-robin so noise hits
    all alike (the fastest run is the one the machine's other load disturbed least; the CPU
    time, this thread's, leaves out the time other processes held the core). Each round takes
    the functions in a new order, and times each one's second call in a row: a function that
    frees much memory (GTPO) would otherwise tax the allocation of whichever runs next."""
    order = list(fns)
    rng = random.Random(0)
    times: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        rng.shuffle(order)
        for name in order:
            fns[name]()
            start, start_cpu = time.perf_counter(), time.thread_time()
            fns[name]()
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.thread_time() - start_cpu)
    return {k: (statistics.median(v), min(v), statistics.median(cpu[k])) for k, v in times.items()}


def synthetic_vocabulary(size: int = VOCAB) -> list[str]:
    """Word pieces with leading spaces, some of them the words of strategic phrases."""
    words = ["wait", "let", "me", "check", "hmm", "actually", "instead", "therefore", "verify"]
    vocabulary = [f" w{i}" for i in range(size)]
    for i, word in enumerate(words):
        vocabulary[i * 97] = f" {word}"
    return vocabulary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    batch = training_batch()
    rng = np.random.default_rng(1)
    n = batch.num_tokens
    entropy = torch.from_numpy(rng.gamma(0.5, 1.0, size=n).astype(np.float32))
    planning = torch.from_numpy((rng.random(n) < 0.15).astype(np.float32))
    print(
        f"batch: {batch.num_groups} groups x 16 rollouts, lengths 1..4096, {n:,} tokens, "
        f"CPU, torch threads {torch.get_num_threads()}, {args.repeats} interleaved rounds"
    )

    def fresh() -> RolloutBatch:
        """The batch without its cached index tensors: a request arrives without them."""
        return RolloutBatch(
            batch.tokens,
            batch.offsets,
            batch.group_index,
            batch.group_ids,
            batch.rewards,
            entropy=entropy,
            planning_mask=planning,
        )

    def run(name: str) -> Callable[[], object]:
        return lambda: compute_batch(fresh(), name, diagnostics=("scalar",))

    # What the keyed path pays per per-position sum: one scatter-add of the entropies into the
    # (class, group, position) keys, the keys given.
    classes = split_classes(batch, 0.0)
    layout = key_layout(batch, classes)
    keys = token_keys(batch, layout)

    def scatter() -> object:
        return torch.zeros(layout.num_keys).index_add_(0, keys, entropy)

    def mask_pass() -> object:
        # HICRA reads the N-long planning mask besides writing the answer GRPO writes.
        return planning * 0.5

    fns = {name: run(name) for name in ESTIMATORS}
    fns[SCATTER] = scatter
    fns[MASK_PASS] = mask_pass
    t = interleaved(fns, args.repeats)
    print("  estimator   median ms  x GRPO   fastest ms  x GRPO   CPU ms  x GRPO")
    for name in (*ESTIMATORS, SCATTER, MASK_PASS):
        (median, fastest, cpu), (grpo_median, grpo_fastest, grpo_cpu) = t[name], t["grpo"]
        goal = f"(goal <= {GOALS[name]:g}x)" if name in GOALS else ""
        print(
            f"  {name:9s} {median * 1e3:10.2f} {median / grpo_median:7.2f}x "
            f"{fastest * 1e3:11.2f} {fastest / grpo_fastest:7.2f}x "
            f"{cpu * 1e3:8.2f} {cpu / grpo_cpu:7.2f}x  {goal}"
        )

    vocabulary = synthetic_vocabulary()
    tokens = batch.tokens.numpy()
    offsets = batch.offsets.numpy()
    strategic_phrase_mask(tokens[:10], np.array([0, 10]), vocabulary)  # vocabulary normalised once
    start = time.perf_counter()
    mask = strategic_phrase_mask(tokens, offsets, vocabulary)
    seconds = time.perf_counter() - start
    print(
        f"planning tokens from strategic phrases (synthetic vocabulary of {len(vocabulary):,}): "
        f"{seconds * 1e3:.0f} ms, {int(mask.sum()):,} tokens marked"
    )


if __name__ == "__main__":
    main()
