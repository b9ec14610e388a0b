"""Per-token methods on the training-sized batch, measured side by side in one process.

    python bench/bench_token_methods.py [--device cpu|cuda] [--repeats 9]

The batch is bench/synthetic.py's: 32 groups x 16 rollouts (512), lengths uniform in
[1, 4096], about 1.05 M tokens. Prints, as ratios of interleaved runs (the machine may be
shared and noisy):
  1. OTB (estimators/otb.py, flat) / verl 0.9.1's compute_optimal_token_baseline_advantage on
     the right-padded (512, 4096) batch it takes (built outside the timing), with and
     without importance weights; and the largest |advantage difference| between the two
  2. forking mask, scope request and scope group / one torch.sort of N float32 values
                                                                (goal: <= 2)
     and TRL's get_high_entropy_mask (torch.quantile on the padded batch) beside them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from advantage_service import RolloutBatch
from advantage_service.estimators.forking import forking_mask
from advantage_service.estimators.otb import optimal_token_baseline
from synthetic import training_batch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(
    fns: dict[str, Callable[[], object]], repeats: int, device: torch.device
) -> dict[str, float]:
    """Median seconds of each function, run round-robin so noise hits all alike."""
    for fn in fns.values():  # warm-up
        fn()
    sync(device)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def token_inputs(batch: RolloutBatch, seed: int = 1) -> dict[str, torch.Tensor]:
    """Per-token inputs as a trainer would send them: behaviour log-probs, consistent sums of
    squared probabilities (S in [pi^2, pi^2 + (1 - pi)^2]), truncated IS weights, entropies."""
    rng = np.random.default_rng(seed)
    n = batch.num_tokens
    pi = rng.beta(2.0, 0.7, size=n)
    sum_pi_squared = pi**2 + (1.0 - pi) ** 2 * rng.uniform(0.0, 1.0, size=n)
    return {
        "logprobs": torch.from_numpy(np.log(np.maximum(pi, 1e-6)).astype(np.float32)),
        "sum_pi_squared": torch.from_numpy(sum_pi_squared.astype(np.float32)),
        "is_weights": torch.from_numpy(np.minimum(rng.lognormal(0, 0.3, n), 2.0).astype("f4")),
        "entropy": torch.from_numpy(rng.gamma(0.5, 1.0, size=n).astype(np.float32)),
    }


def right_padded(batch: RolloutBatch, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(mask.shape, dtype=values.dtype, device=values.device)
    out[mask.bool()] = values
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    device = torch.device(args.device)

    from accelerate import Accelerator
    from trl.trainer.grpo_trainer import GRPOTrainer
    from verl.trainer.ppo.core_algos import compute_optimal_token_baseline_advantage

    batch = training_batch().to(device)
    n = batch.num_tokens
    inputs = {k: v.to(device) for k, v in token_inputs(batch).items()}
    print(
        f"batch: {batch.num_groups} groups x 16 rollouts, lengths 1..4096, {n:,} tokens, "
        f"device {device}, torch threads {torch.get_num_threads()}"
    )

    def fresh() -> RolloutBatch:
        """The batch without its cached index tensors: a request arrives without them."""
        return RolloutBatch(
            batch.tokens, batch.offsets, batch.group_index, batch.group_ids, batch.rewards
        )

    # verl's layout, built once outside the timing (a trainer's batch already has it)
    width = int(batch.lengths.max())
    mask = (torch.arange(width, device=device)[None, :] < batch.lengths[:, None]).float()
    token_level_rewards = torch.zeros_like(mask)
    token_level_rewards[torch.arange(batch.num_rollouts), batch.lengths - 1] = batch.rewards
    uid = np.array([batch.group_ids[g] for g in batch.group_index.tolist()], dtype=object)
    padded = {k: right_padded(batch, v, mask) for k, v in inputs.items()}

    def verl(weights: bool) -> torch.Tensor:
        return compute_optimal_token_baseline_advantage(
            token_level_rewards,
            mask,
            uid,
            padded["logprobs"],
            padded["sum_pi_squared"],
            rollout_is_weights=padded["is_weights"] if weights else None,
        )[0]

    def ours(weights: bool) -> torch.Tensor:
        return optimal_token_baseline(
            fresh(),
            inputs["logprobs"],
            inputs["sum_pi_squared"],
            inputs["is_weights"] if weights else None,
        ).advantage

    worst = max(float((ours(w) - verl(w)[mask.bool()].double()).abs().max()) for w in (False, True))
    trainer = SimpleNamespace(accelerator=Accelerator(cpu=device.type == "cpu"))
    trl_mask = GRPOTrainer.get_high_entropy_mask(trainer, padded["entropy"], mask, 0.8)
    same_mask = torch.equal(forking_mask(fresh(), inputs["entropy"], 0.2), trl_mask[mask.bool()])

    values = inputs["entropy"].clone()
    t = interleaved(
        {
            "otb": lambda: ours(False),
            "verl": lambda: verl(False),
            "otb_is": lambda: ours(True),
            "verl_is": lambda: verl(True),
            "sort": lambda: torch.sort(values),
            "fork_request": lambda: forking_mask(fresh(), inputs["entropy"], 0.2, "request"),
            "fork_group": lambda: forking_mask(fresh(), inputs["entropy"], 0.2, "group"),
            "trl": lambda: GRPOTrainer.get_high_entropy_mask(trainer, padded["entropy"], mask, 0.8),
        },
        args.repeats,
        device,
    )
    rows = [
        ("OTB, flat (this service)", t["otb"]),
        ("OTB, verl 0.9.1, padded", t["verl"]),
        ("OTB + IS weights, flat", t["otb_is"]),
        ("OTB + IS weights, verl", t["verl_is"]),
        ("torch.sort of N float32", t["sort"]),
        ("forking mask, scope request", t["fork_request"]),
        ("forking mask, scope group", t["fork_group"]),
        ("TRL get_high_entropy_mask, padded", t["trl"]),
    ]
    for name, sec in rows:
        print(f"  {name:36s} {sec * 1e3:9.2f} ms")
    print(
        f"OTB / verl                   = {t['otb'] / t['verl']:.2f} "
        f"(with IS weights {t['otb_is'] / t['verl_is']:.2f}); "
        f"max |advantage diff| {worst:.1e}"
    )
    print(
        f"forking / sort               = {t['fork_request'] / t['sort']:.2f} request, "
        f"{t['fork_group'] / t['sort']:.2f} group   (goal <= 2); "
        f"TRL / sort = {t['trl'] / t['sort']:.2f}; request mask equals TRL's: {same_mask}"
    )


if __name__ == "__main__":
    main()
